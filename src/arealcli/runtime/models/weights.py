"""HF weights on disk: read an export's safetensors, load them into a built module, write an export."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch


def read_hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files of an HF directory."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    return state


def load_hf_weights(module: torch.nn.Module, hf_dir: str | Path) -> None:
    """Load the safetensors weights of an HF export into an already-built module."""
    missing, unexpected = module.load_state_dict(read_hf_state(hf_dir), strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"checkpoint {hf_dir} does not match the model: missing {missing}, unexpected {unexpected}"
        )
    tie_weights = getattr(module, "tie_weights", None)  # transformers: lm_head shares the embeddings
    if tied and tie_weights is not None:
        tie_weights()


def export_hf(module, tokenizer, directory: Path) -> None:
    """Write an HF directory atomically (temporary directory + rename)."""
    if directory.exists():
        shutil.rmtree(directory)
    tmp = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    module.save_pretrained(str(tmp), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, directory)
