"""Rule-based math reward: extract the final answer, normalize it, compare it with the references.

Pipeline:

1. ``extract_answer``: the last ``\\boxed{...}`` / ``\\fbox{...}`` (brace-matched), else a
   "the answer is X" / "answer: X" / "#### X" line, else the last number in the text.
2. ``normalize_answer``: strip ``$``, ``\\left``/``\\right``, spacing commands, units, degrees,
   ``%``, thousands commas, a leading ``x =``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``.
3. ``answers_equivalent``: exact string match after normalization, else numeric comparison with a
   relative tolerance, else symbolic comparison with ``math_verify`` (whose ``verify`` includes
   sympy's ``simplify(a - b) == 0``).

Percentages: ``%`` is stripped by normalization, so ``50\\%`` equals ``50``; numerically a value
written with ``%`` also matches its value / 100, so ``50\\%`` equals ``0.5`` too (the same rule
``math_verify`` uses). ``0.5`` and ``50`` without a ``%`` on either side are different.

``MathVerifier`` runs every check in a persistent worker subprocess (a fresh ``python -c``, never a
fork, so it is safe beside CUDA and from any thread of the caller) under a per-item timeout: an item
that takes longer than ``timeout_s`` scores 0.0, the worker is killed and restarted, and the batch
goes on.

Untrusted model text is never handed to ``eval``-based parsers (``sympy.parse_expr``) directly;
sympy objects come only from ``math_verify``'s LaTeX / restricted-expression parsers.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import multiprocessing
import re
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "MathVerifier",
    "answers_equivalent",
    "extract_answer",
    "math_reward",
    "normalize_answer",
]

# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE_RE = re.compile(r"\\boxed +([^\s${}]+)")  # "\boxed 5" (no braces)
_ANSWER_PATTERNS = [
    re.compile(r"####\s*(?P<ans>[^\n]+)"),
    re.compile(r"\b(?:final\s+)?answer\s+is\b\s*:?\s*(?P<ans>[^\n]+)", re.IGNORECASE),
    re.compile(r"\banswer\s*:\s*(?P<ans>[^\n]+)", re.IGNORECASE),
]
# A number: thousands-comma form, or plain int/decimal with an optional "/denominator".
_NUMBER_RE = re.compile(
    r"(?:(?<![\w.)\]}])-)?"  # a minus sign, unless it is a binary minus ("3-4")
    r"(?<![\w.])"
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])"  # 1,234,567.89
    r"|\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)?"  # 42, 3.14, 3/4
    r"|\.\d+)"  # .5
)


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of each ``{`` -> index of its matching ``}``, in one pass; escaped ``\\{ \\}`` ignored."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for i, c in enumerate(text):
        if c in "{}" and i > 0 and text[i - 1] == "\\":
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def _last_boxed(text: str) -> str | None:
    """Content of the last brace-matched ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    opens = [m.end() - 1 for m in _BOXED_RE.finditer(text)]
    if opens:
        pairs = _brace_pairs(text)
        for open_idx in reversed(opens):
            if open_idx in pairs:
                return text[open_idx + 1 : pairs[open_idx]].strip()
    bare = _BOXED_BARE_RE.findall(text)
    return bare[-1] if bare else None


def _clean_pattern_answer(ans: str) -> str:
    ans = re.split(r"\.\s", ans, maxsplit=1)[0]  # stop at the end of the sentence
    ans = ans.strip().rstrip(".").strip()
    if len(ans) >= 2 and ans[0] == "$" and ans[-1] == "$":
        ans = ans.strip("$").strip()
    return ans


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None.

    Order: the last brace-matched ``\\boxed{...}``/``\\fbox{...}``; else the last "#### X",
    "the answer is X" or "answer: X" (X up to the end of its line or sentence); else the last
    number in the text (commas of "1,234" removed). The boxed content is returned verbatim.
    """
    if not isinstance(text, str) or not text:
        return None
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    best: tuple[int, str] | None = None
    for pattern in _ANSWER_PATTERNS:
        for m in pattern.finditer(text):
            ans = _clean_pattern_answer(m.group("ans"))
            if ans and (best is None or m.start() > best[0]):
                best = (m.start(), ans)
    if best is not None:
        return best[1]
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return numbers[-1].replace(",", "")
    return None


# ---------------------------------------------------------------------------------------------
# Normalization
# ---------------------------------------------------------------------------------------------

_TEXT_CMDS = r"(?:text|textrm|textbf|textit|mbox|mathrm|mathbf)"
_TRAILING_UNIT_RE = re.compile(
    r"^(?P<head>.*\S)\s*\\(?P<cmd>text|mbox|mathrm)\{[\s~]*(?P<unit>[A-Za-z][A-Za-z\s.~]*)\}(?:\^\{?\d\}?)?$"
)
_TEXT_WRAP_RE = re.compile(r"\\" + _TEXT_CMDS + r"\s*\{([^{}]*)\}")
_UNIT_WORD = r"[A-Za-z]{2,}\.?(?:\^\d)?"
_BARE_UNITS_RE = re.compile(rf"^(?P<num>[-+]?\d[\d.,/]*)\s+(?P<words>{_UNIT_WORD}(?:\s+{_UNIT_WORD})*)$")
_NOT_UNITS = {"pi", "sqrt", "frac", "infty", "inf", "e", "i"}
_ASSIGN_RE = re.compile(r"^(?:[A-Za-z](?:_\{?\w+\}?)?|\\[A-Za-z]+)\s*=(?!=)(?P<rhs>.*)$", re.DOTALL)
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _fix_short_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{x}`` -> ``\\frac{1}{x}``, ``\\sqrt2`` -> ``\\sqrt{2}``."""
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt\s*(\d+|[A-Za-z](?![A-Za-z]))", r"\\sqrt{\1}", s)
    return s


def _squeeze_spaces(s: str) -> str:
    """Remove whitespace, except a single space that ends a command before a letter (``\\pi r``)."""
    s = re.sub(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])", "\\1\x00", s)
    s = re.sub(r"\s+", "", s)
    return s.replace("\x00", " ")


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer, for exact comparison and as input to the parsers."""
    if not isinstance(s, str):
        s = str(s)
    s = s.strip()
    s = s.replace("\\$", "").replace("$", "")
    # Display-math delimiters around the whole answer.
    m = re.fullmatch(r"\s*\\[(\[](.*)\\[)\]]\s*", s, re.DOTALL)
    if m:
        s = m.group(1)
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
    s = s.replace("\\!", "")
    s = re.sub(r"\\[,;: ]|\\q?quad(?![A-Za-z])|~", " ", s)
    s = re.sub(r"\\displaystyle(?![A-Za-z])", "", s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    # Degrees: ^\circ, ^{\circ}, \circ, \degree, the degree sign.
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])|°", "", s)
    # Percent: the sign is dropped here; answers_equivalent also accepts value / 100.
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    # A unit in \text{...} after the value ("5\text{ cm}^2"); other \text{X} unwrap to X.
    m = _TRAILING_UNIT_RE.match(s)
    if m and (m.group("cmd") != "mathrm" or len(m.group("unit").strip()) >= 2):  # \mathrm{e} is no unit
        s = m.group("head")
    for _ in range(3):  # nested \text{\textbf{..}} unwraps a level per pass
        s = _TEXT_WRAP_RE.sub(r"\1", s)
    s = s.strip().rstrip(".").strip()
    # A leading assignment: "x = 3", "\theta = 30", "x_1 = 2" -> the right-hand side.
    m = _ASSIGN_RE.match(s)
    if m and "=" not in m.group("rhs"):
        s = m.group("rhs").strip()
    s = _fix_short_fracs(s)
    s = s.replace("{,}", ",")
    # A bare unit word after a plain number ("18 dollars", "5 cm").
    m = _BARE_UNITS_RE.match(s)
    if m and not {w.lower().rstrip(".") for w in m.group("words").split()} & _NOT_UNITS:
        s = m.group("num")
    s = _squeeze_spaces(s)
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    # Multiple-choice letter in parentheses: "(B)" -> "B".
    m = re.fullmatch(r"\(([A-Ea-e])\)", s)
    if m:
        s = m.group(1)
    return s.rstrip(".")


# ---------------------------------------------------------------------------------------------
# Equivalence
# ---------------------------------------------------------------------------------------------

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_PLAIN_NUM_RE = re.compile(rf"^{_NUM}$")
_SLASH_FRAC_RE = re.compile(rf"^(?P<sign>[-+]?)(?P<a>{_NUM})/(?P<b>{_NUM})$")
_LATEX_FRAC_RE = re.compile(rf"^(?P<sign>[-+]?)\\frac\{{(?P<a>{_NUM})\}}\{{(?P<b>{_NUM})\}}$")


def _parse_number(s: str) -> float | None:
    """Float value of a normalized int / decimal / ``a/b`` / ``\\frac{a}{b}``; else None."""
    if _PLAIN_NUM_RE.match(s):
        return float(s)
    m = _SLASH_FRAC_RE.match(s) or _LATEX_FRAC_RE.match(s)
    if m:
        b = float(m.group("b"))
        if b == 0:
            return None
        value = float(m.group("a")) / b
        return -value if m.group("sign") == "-" else value
    return None


def _close(a: complex, b: complex, rel_tol: float) -> bool:
    """``|a - b| <= rel_tol * max(|a|, |b|)`` (exact for a == b == 0)."""
    return abs(a - b) <= rel_tol * max(abs(a), abs(b))


def _numeric_candidates(value: float, raw: str) -> list[float]:
    """A value written with ``%`` may mean itself or value / 100."""
    return [value, value / 100] if "%" in raw else [value]


def _math_verify_timeout() -> int | None:
    """math_verify's own timeouts use signal.alarm, which works only in the main thread."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def _first_sympy(parsed: list[Any]) -> Any:
    return next((p for p in parsed if not isinstance(p, str)), None)


def _braces_balanced(s: str) -> bool:
    depth = 0
    for c in re.sub(r"\\[{}]", "", s):
        depth += (c == "{") - (c == "}")
        if depth < 0:
            return False
    return depth == 0


def _symbolic_equivalent(pred: str, ref: str, rel_tol: float) -> bool:
    import math_verify

    # Both are wrapped in \boxed{...} for the parser: a stray "}" would end the box early and let
    # "3}+1" pass for "3".
    if not (_braces_balanced(pred) and _braces_balanced(ref)):
        return False
    t = _math_verify_timeout()
    gold = math_verify.parse("\\boxed{" + ref + "}", parsing_timeout=t)
    target = math_verify.parse("\\boxed{" + pred + "}", parsing_timeout=t)
    g, p = _first_sympy(gold), _first_sympy(target)
    if g is None or p is None:
        return False
    # Two numbers (2\sqrt{2}, \pi, 1/3): compare values under rel_tol, like plain numbers.
    if getattr(g, "is_number", False) and getattr(p, "is_number", False):
        gv: complex | None
        pv: complex | None
        try:
            gv, pv = complex(g.evalf(30)), complex(p.evalf(30))
        except OverflowError:
            return False  # astronomically large values; a symbolic check would only hang
        except (TypeError, ValueError):
            gv = pv = None  # zoo, nan, ... -> let math_verify decide
        if (
            gv is not None
            and pv is not None
            and all(map(math.isfinite, (gv.real, gv.imag, pv.real, pv.imag)))
        ):
            return _close(gv, pv, rel_tol)
    # verify tries string, numeric and symbolic (sympy simplify(a - b) == 0) equality, plus
    # relations, sets, intervals and matrices.
    return bool(math_verify.verify(gold, target, timeout_seconds=t))


def answers_equivalent(pred: str, ref: str, rel_tol: float = 1e-4) -> bool:
    """True if ``pred`` and ``ref`` denote the same answer. Never raises (garbage -> False).

    Exact after normalization; else numeric (ints, decimals, ``a/b``, ``\\frac{a}{b}``, percent;
    ``|a - b| <= rel_tol * max(|a|, |b|)``); else symbolic via ``math_verify``. This function has no
    timeout of its own beyond math_verify's (main thread only): use ``MathVerifier`` on untrusted
    model output.
    """
    try:
        # Numbers from a dataset (42, 0.5) are fine; anything else that is not text is garbage.
        pred, ref = (
            str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x for x in (pred, ref)
        )
        if not isinstance(pred, str) or not isinstance(ref, str):
            return False
        np_, nr = normalize_answer(pred), normalize_answer(ref)
        if not np_ or not nr:
            return False
        if np_ == nr:
            return True
        pv, rv = _parse_number(np_), _parse_number(nr)
        if pv is not None and rv is not None:
            # Both plain numbers: the tolerance decides; a symbolic check cannot add anything.
            return any(
                _close(a, b, rel_tol)
                for a in _numeric_candidates(pv, pred)
                for b in _numeric_candidates(rv, ref)
            )
        return _symbolic_equivalent(np_, nr, rel_tol)
    except Exception:  # noqa: BLE001 - a reward must never crash training
        logger.debug("answers_equivalent failed on %r vs %r", pred, ref, exc_info=True)
        return False


def _reference_answer(ref: str) -> str:
    """References sometimes carry a full solution ("... #### 72", "... \\boxed{5}")."""
    if "\\boxed" in ref or "\\fbox" in ref or "####" in ref:
        return extract_answer(ref) or ref
    return ref


def score_response(response: str, answers: Sequence[str]) -> float:
    """1.0 if the answer extracted from ``response`` matches any reference, else 0.0. No timeout."""
    pred = extract_answer(response)
    if pred is None:
        return 0.0
    return 1.0 if any(answers_equivalent(pred, _reference_answer(a)) for a in answers) else 0.0


def _slow_check_for_tests(response: str, answers: Sequence[str]) -> float:
    """Fault-injection hook for tests, run in the worker in place of ``score_response``.

    ``"SLEEP <seconds>"`` sleeps, then scores 1.0 (a pathological, slow item); ``"CRASH"`` kills the
    worker process; anything else is scored normally. Use ``MathVerifier(_check=_slow_check_for_tests)``.
    """
    import os
    import time

    m = re.fullmatch(r"SLEEP ([\d.]+)", response)
    if m:
        time.sleep(float(m.group(1)))
        return 1.0
    if response == "CRASH":
        os._exit(3)
    return score_response(response, answers)


# ---------------------------------------------------------------------------------------------
# Worker process with a per-item timeout
# ---------------------------------------------------------------------------------------------

_Check = Callable[[str, Sequence[str]], float]

# The worker runs as ``python -c`` rather than through multiprocessing's "spawn": spawn re-imports
# the caller's ``__main__`` in the child (a training script and its torch import, or an unguarded
# script's top-level code) and fails outright for stdin or notebook mains. The pipe and message
# framing are still multiprocessing's.
_WORKER_CODE = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "from arealcli.runtime.rewards.math_verifier import _worker_main; _worker_main(int(sys.argv[1]))"
)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Child-side watchdog: the parent died (even by SIGKILL) -> exit, even mid-item."""
    import os
    import time

    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _worker_main(fd: int) -> None:
    """Child process: receive the check, then ``(response, answers)`` -> float until ``None``."""
    import os
    import signal
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    conn = Connection(fd)
    check: _Check = conn.recv()
    answers_equivalent("2\\sqrt{2}", "\\sqrt{8}")  # warm up: sympy, the LaTeX parser, simplify
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if msg is None:
            return
        response, answers = msg
        try:
            score = float(check(response, answers))
        except Exception:  # noqa: BLE001 - a bad item scores 0.0, the worker lives on
            score = 0.0
        conn.send(score)


def _kill_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
        pass


class MathVerifier:
    """Scores responses against reference answers, each item under a ``timeout_s`` limit.

    The checks run in one persistent worker subprocess, started on first use and reused; an item
    that exceeds ``timeout_s`` (or crashes the worker) scores 0.0 and the worker is restarted
    (startup time is not charged to any item). Thread-safe, and usable from any thread: the caller's
    process sees no signals. Call ``close()`` or use it as a context manager.

    ``_check`` is a test-only fault-injection hook: a picklable module-level function the worker runs
    in place of ``score_response`` (see ``_slow_check_for_tests``).
    """

    def __init__(
        self, timeout_s: float = 5.0, *, startup_timeout_s: float = 120.0, _check: _Check | None = None
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s})")
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._check: _Check = _check or score_response
        self._proc: subprocess.Popen | None = None
        self._conn: Any = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()
        self.num_restarts = 0  # workers killed because an item timed out or crashed them

    # -- worker lifecycle ------------------------------------------------------------------------
    def _start(self) -> None:
        parent_conn, child_conn = multiprocessing.Pipe(duplex=True)
        child_fd = child_conn.fileno()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, str(child_fd), json.dumps(sys.path)],
                pass_fds=(child_fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        finally:
            child_conn.close()  # only the child holds its end, so EOF reaches us if it dies
        self._finalizer = weakref.finalize(self, _kill_process, proc)  # on GC or interpreter exit
        self._proc, self._conn = proc, parent_conn
        try:
            parent_conn.send(self._check)
            ready = parent_conn.poll(self.startup_timeout_s) and parent_conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._kill()
            raise RuntimeError(
                f"math verifier worker did not start within {self.startup_timeout_s:.0f}s "
                f"(exit code {proc.returncode}); see its traceback above, and check that "
                "`python -c 'import arealcli, math_verify'` works in this environment"
            )

    def _kill(self) -> None:
        proc, conn, finalizer = self._proc, self._conn, self._finalizer
        self._proc = self._conn = self._finalizer = None
        if finalizer is not None:
            finalizer.detach()
        if proc is not None:
            _kill_process(proc)
        if conn is not None:
            conn.close()

    def _ensure_worker(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()

    def _score_one(self, response: str, answers: list[str]) -> float:
        self._ensure_worker()
        try:
            self._conn.send((response, answers))
        except OSError:  # died between items: restart and retry once
            self._kill()
            self._ensure_worker()
            self._conn.send((response, answers))
        if self._conn.poll(self.timeout_s):
            try:
                return float(self._conn.recv())
            except (EOFError, OSError):
                logger.warning("math verifier: the worker crashed on an item; scoring it 0.0")
        else:
            logger.warning(
                "math verifier: an item took longer than %.1fs; scoring it 0.0 and restarting the "
                "worker (response tail: %r)",
                self.timeout_s,
                response[-200:],
            )
        self.num_restarts += 1
        self._kill()
        return 0.0

    # -- public API ------------------------------------------------------------------------------
    def score(self, response: str, answers: Sequence[str]) -> float:
        """1.0 if the answer extracted from ``response`` matches any of ``answers``, else 0.0."""
        return self.score_batch([response], [answers])[0]

    def score_batch(self, responses: Sequence[str], answers: Sequence[Sequence[str]]) -> list[float]:
        """``score`` for each ``(responses[i], answers[i])``; each item under its own timeout."""
        if len(responses) != len(answers):
            raise ValueError(
                f"score_batch needs one list of reference answers per response "
                f"(got {len(responses)} responses and {len(answers)} answer lists)"
            )
        items = [
            (r if isinstance(r, str) else str(r), [a] if isinstance(a, str) else [str(x) for x in a])
            for r, a in zip(responses, answers, strict=True)
        ]
        with self._lock:
            return [self._score_one(r, a) for r, a in items]

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            self._kill()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: MathVerifier | None = None
_shared_lock = threading.Lock()


def math_reward(responses: Sequence[str], answers: Sequence[Sequence[str]]) -> list[float]:
    """Score a batch with a process-wide ``MathVerifier`` (created on first use, closed at exit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MathVerifier()
            atexit.register(_shared.close)
        verifier = _shared
    return verifier.score_batch(responses, answers)
