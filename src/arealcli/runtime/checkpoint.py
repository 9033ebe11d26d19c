"""Atomic checkpoints: written to a temporary directory, then renamed; `LATEST` names the newest.

Layout: `<run>/checkpoints/step_00000010/{<model>/ (HF export + engine_state.pt), trainer_state.pt}`.
A crash mid-write leaves only a `.tmp-*` directory, which resume ignores and removes.
Over several processes every rank writes its part into the temporary directory; rank 0 ("main")
creates it and, after all ranks are done, publishes it.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LATEST = "LATEST"


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
    if is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    write_fn(tmp)
    barrier()
    if is_main:
        _publish(ckpt_root, tmp, final, keep_last)
    barrier()
    return final


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
    """The newest complete checkpoint (LATEST, else the highest step_* directory).

    With `cleanup`, leftover temporary directories of interrupted writes are removed.
    """
    if not ckpt_root.exists():
        return None
    for tmp in ckpt_root.glob(".tmp-*") if cleanup else ():
        shutil.rmtree(tmp, ignore_errors=True)
    marker = ckpt_root / LATEST
    if marker.exists():
        candidate = ckpt_root / marker.read_text().strip()
        if (candidate / "trainer_state.pt").exists():
            return candidate
    complete = sorted(p for p in ckpt_root.glob("step_*") if (p / "trainer_state.pt").exists())
    return complete[-1] if complete else None


def load_hf_weights(module: torch.nn.Module, hf_dir: Path) -> None:
    """Load the safetensors weights of an HF export into an already-built module."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    missing, unexpected = module.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"checkpoint {hf_dir} does not match the model: missing {missing}, unexpected {unexpected}"
        )
    if tied and hasattr(module, "tie_weights"):
        module.tie_weights()
