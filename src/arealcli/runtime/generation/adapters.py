"""Several LoRA adapters served over one base model, each request picking one by name.

The base weights stay as they are; an adapter is held apart as its low-rank factors, and a forward
hook on every adapted linear layer adds, to the rows of the batch that asked for that adapter,

    y += scale * B (A x)        scale = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)

which is peft's LoRA forward: the output of the merged weights W + scale * B A, up to float rounding.
Rows of different adapters (and of the base) decode in one batch; rows are the first dimension of
every linear layer's input in the decoder's passes.

An adapter is a folder in peft's format (`adapter_config.json` + `adapter_model.safetensors`, as
`PeftModel.save_pretrained`, `areal export --adapter` and a LoRA run's adapter-only weight updates
write it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from arealcli.runtime.models.lora import ADAPTER_CONFIG, ADAPTER_FILE, lora_factors, lora_scale

NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,99}$")


class AdapterError(ValueError):
    """An adapter that cannot be served (its folder, its config, or its shapes); the message says why."""


@dataclass
class Adapter:
    name: str
    path: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A (r, in), B (out, r))
    scale: float
    rank: int
    version: str = ""


def read_adapter(
    path: str, config: dict, state: dict[str, torch.Tensor]
) -> tuple[dict[str, tuple], float, int]:
    """(module name -> (A, B), scale, rank) of the adapter in folder `path`: its adapter_config.json
    (`config`) and its tensors (`state`)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path} holds a {config.get('peft_type')} adapter; only LoRA adapters are served")
    unsupported = [
        f"{key}={config[key]!r}"
        for key, plain in (("use_dora", False), ("modules_to_save", None), ("bias", "none"))
        if config.get(key) not in (None, plain, [])
    ]
    if unsupported:
        raise AdapterError(f"{path}: {', '.join(unsupported)} is not supported (plain LoRA layers only)")
    try:
        layers = lora_factors(state)
    except ValueError as e:
        raise AdapterError(f"{path}: {e}") from None
    if not layers:
        raise AdapterError(f"{path} holds no LoRA tensors (*.lora_A.weight / *.lora_B.weight)")
    return layers, lora_scale(config), int(config.get("r", 8))


class ServedAdapters:
    """The adapters a served module answers with, by name; `use(names)` around a forward pass picks one
    (or None: the base) per row."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.linears = {n: m for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
        self.adapters: dict[str, Adapter] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._groups: list[tuple[Adapter, torch.Tensor | None]] = []  # the forward pass's rows

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def version(self, name: str) -> str:
        return self.adapters[name].version

    def add(
        self, name: str, path: str, state: dict[str, torch.Tensor], config: dict, version: str = ""
    ) -> Adapter:
        """Serve the adapter with tensors `state` and adapter_config.json `config` (read from folder `path`)
        as `name`, replacing one of that name; checked against the module first (nothing changes when it
        does not fit)."""
        if not NAME.match(name):
            raise AdapterError(
                f"adapter name {name!r}: use letters, digits and _ . : - (at most 100 characters)"
            )
        layers, scale, rank = read_adapter(path, config, state)
        param = next(self.module.parameters())
        placed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for stem, (a, b) in layers.items():
            layer = self.linears.get(stem)
            if layer is None:
                raise AdapterError(f"{path}: the served model has no linear layer {stem}")
            inner = a.dim() == b.dim() == 2 and b.shape[1] == a.shape[0]  # B A is (out, in)
            if not inner or (b.shape[0], a.shape[1]) != tuple(layer.weight.shape):
                raise AdapterError(
                    f"{path}: {stem} does not fit the served model (A {tuple(a.shape)}, B {tuple(b.shape)}; "
                    f"the layer is {layer.in_features} -> {layer.out_features})"
                )
            placed[stem] = (
                a.to(param.device, param.dtype).contiguous(),
                b.to(param.device, param.dtype).contiguous(),
            )
        adapter = Adapter(name, path, placed, scale, rank, version)
        self.adapters[name] = adapter
        self._hook_layers()
        return adapter

    def remove(self, name: str) -> None:
        del self.adapters[name]
        self._hook_layers()

    def _hook_layers(self) -> None:
        """Hooks on exactly the layers some adapter adapts."""
        wanted = {stem for a in self.adapters.values() for stem in a.layers}
        for stem in set(self._hooks) - wanted:
            self._hooks.pop(stem).remove()
        for stem in wanted - set(self._hooks):
            self._hooks[stem] = self.linears[stem].register_forward_hook(self._hook(stem))

    def _hook(self, stem: str):
        def add_deltas(layer, args, out):
            for adapter, rows in self._groups:
                factors = adapter.layers.get(stem)
                if factors is None:
                    continue
                a, b = factors
                x = args[0] if rows is None else args[0][rows]
                delta = (x.to(a.dtype) @ a.T @ b.T * adapter.scale).to(out.dtype)
                out = out + delta if rows is None else out.index_add(0, rows, delta)
            return out

        return add_deltas

    @contextmanager
    def use(self, names: list[str | None]) -> Iterator[None]:
        """Within: row i of every forward pass answers with adapter names[i] (None: the base)."""
        if not self.adapters:  # nothing served but the base (every decoding step passes here)
            yield
            return
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            if name is not None:
                groups.setdefault(name, []).append(i)
        device = next(self.module.parameters()).device
        self._groups = [
            (
                self.adapters[name],
                None if len(rows) == len(names) else torch.tensor(rows, dtype=torch.long, device=device),
            )
            for name, rows in groups.items()
        ]
        try:
            yield
        finally:
            self._groups = []


def adapter_files(path: str) -> list[str]:
    """The files an adapter folder needs, missing ones (for a clear refusal before loading)."""
    return [f for f in (ADAPTER_CONFIG, ADAPTER_FILE) if not os.path.isfile(os.path.join(path, f))]
