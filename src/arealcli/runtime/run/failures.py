"""How a failed run ends, and whether it starts again by itself.

A failure a user can act on is one message, not a traceback: what failed, what to change where there is
something to change, the checkpoint kept and the command that continues. The traceback goes to
`RUN/logs/crash.log` (appended, one block per failure). A real bug says so and points to that file.

Recovery (`trainer.recover: {mode: auto, retries: 3}`): the run starts again from its last complete
checkpoint, as `--resume` would, at most `retries` times per command. Not retried, because starting
again would fail the same way: a failure before the first checkpoint; the same failure again from the
same checkpoint (a deterministic bug); bad input and a loss that is not finite (exit 2, never here).
"""

from __future__ import annotations

import datetime
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

# the last line of a Python traceback: `package.module.TypeName: message`
_LAST_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception|Exit|Interrupt)\w*): ?(.*)$")

_OOM = ("OutOfMemoryError", "MemoryError")
_GENERATION = ("GenerationServerError",)
# a reward service, a judge or a served teacher that refused, broke or did not answer
_SCORING = ("RemoteRewardError", "JudgeError", "TeacherError")
_PEERS = ("DistBackendError", "DistNetworkError", "DistError", "ChildFailedError")


@dataclass
class Failure:
    what: str  # one line: what failed
    hint: str | None  # what to change, where there is something to change
    bug: bool  # nothing a user did: arealcli's or a plugin's bug, to report with crash.log
    signature: str  # the same failure, seen again, has the same signature
    crash_log: Path

    def lines(self) -> list[str]:
        out = [self.what]
        if self.hint:
            out.append(self.hint)
        if self.bug:
            out.append(
                f"this looks like a bug (in arealcli or in a plugin): the traceback is in {self.crash_log}"
            )
        else:
            out.append(f"the traceback: {self.crash_log}")
        return out


def failure_of(error: BaseException | str, run_dir: Path, step: int | None = None) -> Failure:
    """Classify an exception of this process, or a worker's traceback text (multi-process runs), and
    append its traceback to `run_dir/logs/crash.log`."""
    if isinstance(error, BaseException):
        kind, message = type(error).__name__, str(error)
        text = "".join(traceback.format_exception(error))
    else:
        text = error
        kind, message = _last_error(text)
    log = write_crash_log(run_dir, text)
    first = message.strip().splitlines()[0] if message.strip() else kind
    at = f" at step {step}" if step is not None else ""
    if not isinstance(error, BaseException) and text.startswith("worker rank "):
        at += f" in {text.split(' failed', 1)[0]}"  # "in worker rank 1"
    signature = f"{kind}: {first}"
    if kind in _GENERATION:
        return Failure(f"generation failed{at}: {message.strip()}", None, False, signature, log)
    if kind in _SCORING:
        return Failure(f"scoring failed{at}: {message.strip()}", None, False, signature, log)
    if kind in _OOM:
        return Failure(
            f"out of memory{at}: {first}",
            "lower the micro-batch (mb_spec.max_tokens_per_mb of the calls), generation.n or "
            "max_new_tokens, or dataset.batch_size",
            False,
            signature,
            log,
        )
    if kind in _PEERS or not kind:  # not kind: a worker that died without a Python error (a signal)
        head = text.strip().splitlines()[0] if text.strip() else first
        return Failure(f"a training process failed{at}: {head}", None, False, signature, log)
    return Failure(f"training failed{at}: {kind}: {first}", None, True, signature, log)


def _last_error(text: str) -> tuple[str, str]:
    """(type name, message) of the last exception in a traceback's text."""
    lines = text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _LAST_LINE.match(lines[i])
        if m:
            return m.group(1), "\n".join([m.group(2), *lines[i + 1 :]])
    return "", lines[-1] if lines else "no message"


def write_crash_log(run_dir: Path, text: str) -> Path:
    path = run_dir / "logs" / "crash.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        with open(path, "a") as f:
            f.write(f"===== {stamp}\n{text.rstrip()}\n\n")
    except OSError:  # a full disk must not hide the failure itself
        pass
    return path


class Recovery:
    """Decides, failure after failure, whether the run starts again from its last checkpoint."""

    def __init__(self, mode: str, retries: int):
        self.mode, self.retries = mode, retries
        self.done = 0  # recoveries so far
        self.seen: set[tuple[int, str]] = set()

    def why_not(self, failure: Failure, checkpoint_step: int | None) -> str | None:
        """None: recover (and remember this failure); else why the run ends here."""
        if self.mode == "off":
            return "automatic recovery is off (trainer.recover.mode)"
        if checkpoint_step is None:
            return "no checkpoint was written yet, so it is not retried automatically"
        if self.done >= self.retries:
            return f"not retried again after {self.done} recoveries (trainer.recover.retries={self.retries})"
        key = (checkpoint_step, failure.signature)
        if key in self.seen:
            return (
                f"the same failure happened again from the checkpoint of step {checkpoint_step}: not retried"
            )
        self.seen.add(key)
        self.done += 1
        return None
