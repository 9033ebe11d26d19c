"""LoRA adapters (peft) for the hf and fsdp backends.

A LoRA model trains only its adapters: W x + (alpha / r) B A x on every targeted linear layer, B starting
at zero. Its checkpoints hold the merged weights, W + (alpha / r) B A, as a plain HF directory (what a
generation server or `from_pretrained` loads), and the adapters themselves in `adapter/` (peft's
`save_pretrained` layout: adapter_config.json + adapter_model.safetensors), which a resume loads back
onto the rebuilt base.
"""

from __future__ import annotations

import os
import warnings

import torch

from arealcli.errors import UserError

ADAPTER_DIR = "adapter"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."  # peft's prefix before the base model's own parameter names


def with_lora(module, cfg, seed: int):
    """`module` with peft LoRA adapters: only they train. Their initial values come from `seed`, so every
    rank (replica or shard owner) starts from the same adapters. A target that matches nothing is the
    user's to fix."""
    from peft import LoraConfig, get_peft_model

    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=devices):
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            torch.manual_seed(seed)  # not the rank's sampling stream: the same adapters everywhere
            return get_peft_model(module, config)
    except ValueError as e:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise UserError(
            f"lora.target_modules {targets} match no layer of the model ({str(e).splitlines()[0]}); its linear "
            f"layers are: {', '.join(linear)}"
        ) from None


def is_lora(module) -> bool:
    return hasattr(module, "peft_config")


def scaling(peft_module, adapter: str = "default") -> float:
    return lora_scale(peft_module.peft_config[adapter].to_dict())


def lora_scale(config: dict) -> float:
    """An adapter's scale from its adapter_config.json: lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)."""
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    return alpha / (r**0.5 if config.get("use_rslora") else r)


def merged_state(
    state: dict[str, torch.Tensor], scale: float, adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict (peft's names) -> the base model's state dict with every adapted
    weight merged: W + scale * B A."""
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if key.endswith(".base_layer.weight"):
            stem = key.removesuffix(".base_layer.weight")
            a, b = state[f"{stem}.lora_A.{adapter}.weight"], state[f"{stem}.lora_B.{adapter}.weight"]
            value = value + (scale * (b.float() @ a.float())).to(value.dtype)
        out[key.removeprefix(_PREFIX).replace(".base_layer.", ".")] = value
    return out


def split_lora_state(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA model's full state dict (peft's names) -> (the base model's weights under its own names,
    the adapters under the base model's module names: `<module>.lora_A.<adapter>.weight`)."""
    base, adapters = {}, {}
    for key, value in state.items():
        name = key.removeprefix(_PREFIX)
        if ".lora_" in key:
            adapters[name] = value
        else:
            base[name.replace(".base_layer.", ".")] = value
    return base, adapters


def save_adapters(peft_module, state: dict[str, torch.Tensor], save_dir: str) -> None:
    """`adapter/` in peft's layout from a full state dict (peft's names, the adapter name dropped)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    path = os.path.join(save_dir, ADAPTER_DIR)
    os.makedirs(path, exist_ok=True)
    adapters = get_peft_model_state_dict(peft_module, state_dict=state)
    save_file({k: v.detach().contiguous() for k, v in adapters.items()}, os.path.join(path, ADAPTER_FILE))
    peft_module.peft_config["default"].save_pretrained(path)


def adapter_state(load_dir: str, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapters saved in a checkpoint, under the model's own parameter names."""
    from safetensors.torch import load_file

    saved = load_file(os.path.join(load_dir, ADAPTER_DIR, ADAPTER_FILE))
    return {
        k.replace(".lora_A.weight", f".lora_A.{adapter}.weight").replace(
            ".lora_B.weight", f".lora_B.{adapter}.weight"
        ): v
        for k, v in saved.items()
    }


def save_base(peft_module, save_dir: str) -> None:
    """The base weights of a LoRA model (what its adapters apply to), unmerged, under the base model's own
    names, as safetensors in `save_dir` (a tied output layer is left out: it is the embeddings)."""
    from safetensors.torch import save_file

    base, _ = split_lora_state(peft_module.state_dict())
    seen: set[int] = set()
    out = {}
    for key, value in base.items():  # tied weights share storage: the first name keeps it
        if value.data_ptr() in seen:
            continue
        seen.add(value.data_ptr())
        out[key] = value.detach().contiguous().cpu()
    os.makedirs(save_dir, exist_ok=True)
    save_file(out, os.path.join(save_dir, "model.safetensors"))


def save_adapter_update(peft_module, save_dir: str, adapter: str = "default") -> None:
    """An adapter-only update in `save_dir`, in peft's format (adapter_config.json + the adapter tensors:
    what vLLM, peft and `areal serve --lora` load). A server that merges it applies it to the base weights
    in the folder above (`apply_adapter_update`)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(save_dir, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(peft_module).items()}
    save_file(tensors, os.path.join(save_dir, ADAPTER_FILE))
    peft_module.peft_config[adapter].save_pretrained(save_dir)


def lora_factors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter's tensors (peft's names) -> {adapted module's name in the base model: (A, B)}; a lora_A
    without its lora_B is an error (ValueError)."""
    out = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        stem = key.removesuffix(".lora_A.weight")
        b = tensors.get(f"{stem}.lora_B.weight")
        if b is None:
            raise ValueError(f"{stem} has lora_A but no lora_B")
        out[stem.removeprefix(_PREFIX)] = (a, b)
    return out


def apply_adapter_update(
    base: dict[str, torch.Tensor], update: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """The adapted weights of an update (its tensors, and its `lora_scale`), under the base model's names:
    W + (B A) * scale, the arithmetic of peft's merge (so a server merging them holds what the trainer's
    merged export holds)."""
    out = {}
    for stem, (a, b) in lora_factors(update).items():
        w = base.get(f"{stem}.weight")
        if w is None or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"the adapter update does not fit the base weights at {stem}")
        out[f"{stem}.weight"] = w + ((b.float() @ a.float()) * scale).to(w.dtype)
    if not out:
        raise ValueError("the adapter update holds no adapter")
    return out
