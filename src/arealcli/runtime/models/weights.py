"""HF weights: on disk (read an export's safetensors, load them into a built module, write an export),
and in memory (`WeightsInMemory`: a trained model's tensors handed to a follower in the same process)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from arealcli.runtime.vision import save_tokenizer

# torch's `weights_only` loader could be talked into constructing objects before 2.6 and had a
# memory-corruption path before 2.10: below this version no checkpoint state is loaded at all.
SAFE_LOADER_TORCH = (2, 10)


def load_plain(path: str | Path, map_location: Any = None) -> Any:
    """A `.pt` file of tensors and plain data (numbers, strings, lists, dicts) and nothing else: torch's
    `weights_only` loader, which refuses a file that would construct other objects (and so run code)."""
    from torch.torch_version import TorchVersion

    from arealcli.errors import UserError

    # TorchVersion compares with tuples (its stub says only with str)
    if TorchVersion(torch.__version__) < SAFE_LOADER_TORCH:  # type: ignore[operator]
        raise UserError(
            f"refusing to load {path} with torch {torch.__version__}: its weights_only loader is not safe "
            f"before {'.'.join(map(str, SAFE_LOADER_TORCH))}; install a newer torch"
        )
    return torch.load(path, map_location=map_location, weights_only=True)


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
    load_state(module, read_hf_state(hf_dir), f"checkpoint {hf_dir}")


def load_state(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load `state` (HF names) into `module`; lm_head may be tied to the embeddings. `where` names the
    source in the error (`checkpoint DIR`, `weights DIR`)."""
    from arealcli.runtime.models.value_head import renamed_legacy_head

    missing, unexpected = module.load_state_dict(renamed_legacy_head(own_names(module, state)), strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{where} does not match the model: missing {missing}, unexpected {unexpected}")
    tie_weights = getattr(module, "tie_weights", None)  # transformers: lm_head shares the embeddings
    if tied and tie_weights is not None:
        tie_weights()


def own_names(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under the module's own parameter names. transformers saves some models under other names
    than their modules use (Qwen2-VL: `visual.*` and `model.layers.*` for `model.visual.*` and
    `model.language_model.layers.*`, the names other tools read); those are mapped back."""
    own = module.state_dict()
    if all(k in own for k in state):
        return state
    mapping = saved_names(module)
    return {mapping.get(k, k): v for k, v in state.items()}


def as_saved(state: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """`state` (a module's own names) under the names `save_pretrained` writes: `names` is the module's
    `saved_names` (taken before a wrapper such as FSDP's hides its class from transformers)."""
    mapping = {own: saved for saved, own in names.items()}
    return {mapping.get(k, k): v for k, v in state.items()}


def saved_names(module: torch.nn.Module) -> dict[str, str]:
    """name in a saved folder -> the module's own name, for the parameters transformers renames on save
    (its `revert_weight_conversion`, applied to the module's names)."""
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        return {}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before its weight conversions renamed nothing
        return {}
    names = list(module.state_dict())
    marked = {name: torch.tensor([i]) for i, name in enumerate(names)}  # each name's tensor says its index
    saved = revert_weight_conversion(module, marked)
    return {key: names[int(t[0])] for key, t in saved.items()}


def export_hf(module, tokenizer, directory: Path) -> None:
    """Write an HF directory atomically (temporary directory + rename)."""
    if directory.exists():
        shutil.rmtree(directory)
    tmp = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    module.save_pretrained(str(tmp), safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, tmp)
    os.replace(tmp, directory)


@dataclass
class WeightsInMemory:
    """New weights for a follower in the same process (`weights_from`), under the HF names of the
    model's parameters; the tensors are the source's own (no copy: the follower copies them).

    full: every tensor (with LoRA: the merged weights, or the base weights when `adapters` is given);
        None when the follower holds them already (LoRA: the base does not train).
    adapters: LoRA A and B matrices under the adapted modules' names (`<module>.lora_A.default.weight`),
        with `lora_config` (peft's LoraConfig) to set the adapters up where they are not yet.
    """

    full: dict[str, torch.Tensor] | None = None
    adapters: dict[str, torch.Tensor] | None = None
    lora_config: Any = None

    def nbytes(self) -> int:
        """Bytes to copy: each tensor once (a tied output layer shares the embeddings' storage)."""
        tensors = [*(self.full or {}).values(), *(self.adapters or {}).values()]
        unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
        return sum(unique.values())


def weights_in_memory(module: torch.nn.Module, adapters_apart: bool) -> WeightsInMemory:
    """A module's weights for a follower in this process. A LoRA module gives its base weights and the
    adapters apart when `adapters_apart`, else the merged weights (computed: W + scale B A)."""
    from arealcli.runtime.models.lora import is_lora, merged_state, scaling, split_lora_state

    state = module.state_dict()
    if not is_lora(module):
        return WeightsInMemory(full=dict(state))
    if not adapters_apart:
        return WeightsInMemory(full=merged_state(state, scaling(module)))
    base, adapters = split_lora_state(state)
    config = getattr(module, "peft_config")["default"]  # noqa: B009  (peft's attribute, untyped)
    return WeightsInMemory(full=base, adapters=adapters, lora_config=config)
