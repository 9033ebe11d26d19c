"""Atomic, verified checkpoints: written to a temporary directory, then renamed; `LATEST` names the newest.

Layout: `<run>/checkpoints/step_00000010/{<model>/ (HF export + engine_state.pt), trainer_state.pt,
manifest.json}`. A crash mid-write leaves only a `.tmp-*` directory, which resume ignores and removes.
Over several processes every rank writes its part into the temporary directory; rank 0 ("main")
creates it and, after all ranks are done, publishes it.

`manifest.json` lists every file of the checkpoint with its size and SHA-256, written last, before the
rename. On resume the newest checkpoint is checked against it: a file missing, truncated or changed
(zeroed bytes included) makes that checkpoint unusable, and resume falls back to the previous complete
one, saying which file was bad. A save that runs out of disk space removes its partial directory, keeps
the previous checkpoint and stops with "no space left on <path>".
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from arealcli.errors import UserError

LATEST = "LATEST"
MANIFEST = "manifest.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def write_checkpoint(
    ckpt_root: Path,
    step: int,
    write_fn,
    keep_last: int,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Call `write_fn(tmp_dir)` then publish the directory atomically; prune old checkpoints.

    Over several processes every rank calls this: the main rank prepares and publishes, `barrier`
    (a collective) orders the steps, and every rank's `write_fn` writes into the same directory.
    """
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".tmp-{final.name}"
    try:
        if is_main:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        barrier()
        write_fn(tmp)
        barrier()
        if is_main:
            write_manifest(tmp)
            _publish(ckpt_root, tmp, final, keep_last)
        barrier()
    except Exception as e:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial checkpoint behind
        if is_disk_full(e, ckpt_root):
            previous = latest_checkpoint(ckpt_root, cleanup=False)
            kept = f"{previous} is kept" if previous is not None else "there is no earlier checkpoint"
            raise UserError(
                f"no space left on {_mount_point(ckpt_root)} while writing the checkpoint of step {step} in "
                f"{ckpt_root}; {kept}. Free some space (or lower trainer.keep_last_n_checkpoints) and "
                "continue with --resume"
            ) from None
        raise
    return final


def is_disk_full(e: BaseException, path: Path) -> bool:
    """Did writing fail for lack of space? ENOSPC anywhere in the chain, a library's own wording of it,
    or a short write (torch: "unexpected pos", "file write failed") with the disk (nearly) full."""
    cause: BaseException | None = e
    for _ in range(8):
        if cause is None:
            break
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(cause) or "Disk quota exceeded" in str(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    short_write = any(m in str(e) for m in ("unexpected pos", "file write failed", "write failed"))
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        return False
    return short_write and free < 64 << 20


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


# ------------------------------------------------------------------ the manifest


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: Path) -> None:
    """Every file below `directory` with its size and SHA-256 (written last, into the directory)."""
    files = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def verify_checkpoint(directory: Path) -> str | None:
    """Why `directory` is not a complete, intact checkpoint, or None. A checkpoint written before
    manifests existed is accepted when its trainer state is there."""
    manifest = directory / MANIFEST
    if not manifest.exists():
        return None if (directory / "trainer_state.pt").exists() else "trainer_state.pt is missing"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for rel, want in files.items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size} bytes, {want['size']} were written"
        if _sha256(path) != want["sha256"]:
            return f"{rel} does not match its checksum (changed or corrupted since it was written)"
    return None


def _publish(ckpt_root: Path, tmp: Path, final: Path, keep_last: int) -> None:
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = ckpt_root / f".{LATEST}.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, ckpt_root / LATEST)
    for old in sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)


def latest_checkpoint(ckpt_root: Path, cleanup: bool = True) -> Path | None:
    """The newest complete checkpoint (LATEST, else the highest step_* directory); not verified.

    With `cleanup`, leftover temporary directories of interrupted writes are removed.
    """
    candidates = _candidates(ckpt_root, cleanup)
    return candidates[0] if candidates else None


def _candidates(ckpt_root: Path, cleanup: bool) -> list[Path]:
    """Published checkpoints, newest first (LATEST's first)."""
    if not ckpt_root.exists():
        return []
    for tmp in ckpt_root.glob(".tmp-*") if cleanup else ():
        shutil.rmtree(tmp, ignore_errors=True)
    steps = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), reverse=True)
    marker = ckpt_root / LATEST
    if marker.exists():
        named = ckpt_root / marker.read_text().strip()
        if named in steps:
            steps.remove(named)
            steps.insert(0, named)
    return [p for p in steps if (p / "trainer_state.pt").exists() or (p / MANIFEST).exists()]


def resume_checkpoint(ckpt_root: Path, cleanup: bool = True) -> tuple[Path, list[str]]:
    """The newest checkpoint that passes `verify_checkpoint`, and what was wrong with newer ones.

    Raises UserError when none is usable (every problem named).
    """
    problems: list[str] = []
    for candidate in _candidates(ckpt_root, cleanup):
        why = verify_checkpoint(candidate)
        if why is None:
            return candidate, problems
        problems.append(f"{candidate}: {why}")
    if not problems:
        raise UserError(f"--resume: {ckpt_root} holds no complete checkpoint")
    raise UserError("--resume: no usable checkpoint in " + str(ckpt_root) + ":\n  " + "\n  ".join(problems))


@contextlib.contextmanager
def reading(path: Path):
    """Loading from a checkpoint: a failure names the file or folder (and is the user's to fix)."""
    try:
        yield
    except UserError:
        raise
    except pickle.UnpicklingError as e:  # weights_only: something other than tensors and plain data
        raise UserError(
            f"refusing to load {path}: it holds Python objects other than tensors, numbers, strings, lists "
            "and dicts, which loading would construct (a checkpoint from elsewhere could run code that way). "
            f"What torch found: {str(e).strip().splitlines()[0][:300]}"
        ) from None
    except Exception as e:  # a truncated or foreign file: torch / safetensors errors
        raise UserError(
            f"cannot load {path} from the checkpoint: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
        ) from None
