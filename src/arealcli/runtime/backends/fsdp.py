"""The FSDP2 backend: a transformers model sharded with `fully_shard` over the data-parallel ranks.

Each decoder layer is its own FSDP unit, then the root (embeddings, final norm, head). Parameters,
gradients and AdamW state live sharded (`DTensor`s); a layer's full parameters exist only around its
forward and backward (all-gather, then reduce-scatter of its gradients).

Collectives must match across ranks, so:
- training and `forward` run the same number of passes on every rank: the maximum micro-batch count
  over ranks, with zero-weight padding passes where a rank has fewer (`run_microbatches`);
- `generate` all-gathers every unit once (`unshard()`), decodes the rank's own slice with the full
  weights and no further collectives (ranks may take different numbers of decoding steps), then
  reshards. The price is one full copy of the weights per rank while generating.
- `save_to_hf` gathers a full state dict on rank 0 (CPU), which writes safetensors
  `AutoModelForCausalLM.from_pretrained` loads; `save`/`load` keep the optimizer state sharded with
  torch.distributed.checkpoint (one file per rank; it also reloads under another world size).
- With `lora`, peft's adapters are added before sharding (frozen base and trainable adapters share the
  units; only adapters carry gradients and optimizer state); the export is the merged model plus
  `adapter/`, and a resume loads the adapters onto the rebuilt base.

Started in a single process (no launcher), the backend makes its own world of one.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, cast

import torch
import torch.distributed as dist

from arealcli.runtime import distributed
from arealcli.runtime.backends import packing
from arealcli.runtime.backends.base import ModelBackend
from arealcli.runtime.backends.hf import generate_on, run_packed
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput
from arealcli.runtime.engines.train import TrainEngine, clip_and_step
from arealcli.runtime.models.lora import (
    adapter_state,
    is_lora,
    merged_state,
    save_adapters,
    scaling,
    with_lora,
)
from arealcli.runtime.models.model import DTYPES, FinetuneSpec, Model
from arealcli.runtime.models.weights import as_saved, saved_names
from arealcli.runtime.optim import begin_step, build_optimizer, require_optimizer
from arealcli.runtime.vision import save_tokenizer
from arealcli.schema.components.backends import FSDPBackendArgs
from arealcli.schema.components.engine import GenerationHyperparameters, OptimizerConfig

_own_process_group = False  # True when this backend created a world of one itself


def _ensure_process_group(device: torch.device) -> None:
    global _own_process_group
    if distributed.initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _own_process_group = True


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: modules whose class transformers marks as not to be split."""
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in module.modules() if type(m).__name__ in names]
    inner: Any = getattr(module, "model", None)
    if not layers and hasattr(inner, "layers"):
        layers = list(inner.layers)
    return layers


def write_hf_checkpoint(
    module: torch.nn.Module,
    architecture: str,
    state: dict[str, torch.Tensor],
    save_dir: str,
    names: dict[str, str] | None = None,
) -> None:
    """An HF directory (config.json + model.safetensors) from a full state dict; `names`: see `as_saved`."""
    from safetensors.torch import save_file
    from transformers import PreTrainedModel

    os.makedirs(save_dir, exist_ok=True)
    config: Any = copy.deepcopy(module.config)  # the transformers config
    if isinstance(module, PreTrainedModel):
        config.architectures = [architecture]  # not the FSDP subclass fully_shard swapped in
    config.save_pretrained(save_dir)
    state = as_saved(
        state, names or {}
    )  # the names other tools read (Qwen2-VL: `visual.*`, `model.layers.*`)
    if getattr(config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in state:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: loaded from the embeddings
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(save_dir, "model.safetensors"), metadata={"format": "pt"})


class FSDPEngine(TrainEngine):
    def __init__(
        self,
        module: torch.nn.Module,
        device: torch.device,
        optimizer_cfg: OptimizerConfig | None,
        total_train_steps: int,
        architecture: str,
        reshard_after_forward: bool,
        saved: dict[str, str] | None = None,
        share_prompts: bool = False,
    ):
        from torch.distributed.fsdp import FSDPModule

        self.module: Any = module  # a transformers model, or peft's wrapper of one (duck-typed)
        self.device, self.architecture = device, architecture
        self.saved = saved or {}  # the names save_pretrained would write (`weights.saved_names`)
        self.optimizer_cfg, self.total_train_steps = optimizer_cfg, total_train_steps
        self.optimizer = build_optimizer(module.parameters(), optimizer_cfg) if optimizer_cfg else None
        self.units = [m for m in module.modules() if isinstance(m, FSDPModule)]  # same order everywhere
        self.reshard_after_forward = reshard_after_forward
        self.share_prompts = share_prompts

    def run_microbatch(self, mb: SequenceSample) -> torch.Tensor | LMOutput:
        return run_packed(self.module, mb, self.device, share_prompts=self.share_prompts)

    def _pad_run(self) -> torch.Tensor:
        """A one-token forward: the collectives of a pass, for ranks with nothing (left) to compute."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        out = self.module(input_ids=ids, attention_mask=torch.ones_like(ids))
        return out.logits if hasattr(out, "logits") else out

    def run_microbatches(self, mbs, on_output, backward: bool) -> None:
        """Every rank runs as many passes as the rank with the most micro-batches: each pass all-gathers
        parameters (and reduce-scatters gradients), so a rank with fewer pads with a zero-weight pass."""
        n_passes = int(self.all_reduce([len(mbs)], op="max")[0])
        for i in range(n_passes):
            with torch.set_grad_enabled(backward):
                if i < len(mbs):
                    loss = on_output(mbs[i], self.run_microbatch(mbs[i]))
                else:
                    out = self._pad_run()
                    loss = out.float().sum() * 0.0 if backward else None
            if backward and loss is not None:
                loss.backward()

    def begin_train_step(self, version_steps: int, lr_scale: float) -> float:
        lr = begin_step(self.optimizer, self.optimizer_cfg, self.total_train_steps, version_steps, lr_scale)
        self.module.train()
        return lr

    def finish_train_step(self, stepped: bool) -> float:
        # FSDP reduce-scattered the gradients as an average over ranks during backward
        # begin_train_step checked that there is an optimizer
        optimizer, cfg = require_optimizer(self.optimizer, self.optimizer_cfg)
        return clip_and_step(self.module.parameters(), optimizer, cfg.gradient_clipping)

    @contextlib.contextmanager
    def generation_context(self):
        """Every unit unsharded (one all-gather each, in the same order on every rank) and kept so:
        the forwards inside run without collectives, and ranks may decode for different lengths."""
        for unit in self.units:
            unit.unshard()
        layers = [u for u in self.units if u is not self.module]  # the root never reshards after forward
        for unit in layers:
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for unit in layers:
                unit.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
            for unit in self.units:
                unit.reshard()

    @property
    def lora(self) -> bool:
        return is_lora(self.module)

    def generate_prompts(
        self,
        prompts,
        g: GenerationHyperparameters,
        eos_ids: set[int],
        pad_id: int,
        stop_texts=None,
        images=None,
    ):
        # with LoRA the adapters sit inside the base model's layers (all unsharded here): run it directly
        module = self.module.get_base_model() if self.lora else self.module
        return generate_on(self, module, prompts, g, eos_ids, pad_id, stop_texts, images)

    def save_to_hf(self, tokenizer, save_dir: str) -> None:
        """Collective: every rank sends its shards; rank 0 writes the HF directory (with LoRA: the merged
        weights, and the adapters in `adapter/`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = cast(  # a full state dict holds plain tensors
            dict[str, torch.Tensor],
            get_model_state_dict(
                self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ),
        )
        if distributed.rank() == 0:
            module = self.module
            if self.lora:
                save_adapters(self.module, state, save_dir)
                state, module = merged_state(state, scaling(self.module)), self.module.get_base_model()
            write_hf_checkpoint(module, self.architecture, state, save_dir, self.saved)
            if tokenizer is not None:
                save_tokenizer(tokenizer, save_dir)

    # ------------------------------------------------------------------ state

    def save_state(self, save_dir: str) -> None:
        """Collective: each rank writes its optimizer shard (torch.distributed.checkpoint)."""
        if self.optimizer is None:
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(self.module, self.optimizer)}
        dcp.save(state, checkpoint_id=os.path.join(save_dir, "optimizer"))

    def load_state(self, load_dir: str) -> None:
        if self.lora:  # every rank reads the adapters; each keeps its shards
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            adapters: dict[str, Any] = {k: v.to(self.device) for k, v in adapter_state(load_dir).items()}
            result = set_model_state_dict(
                self.module, adapters, options=StateDictOptions(full_state_dict=True, strict=False)
            )
            if result.unexpected_keys:
                raise RuntimeError(
                    f"adapters in {load_dir} do not fit the model: {result.unexpected_keys[:5]}"
                )
        path = os.path.join(load_dir, "optimizer")
        if self.optimizer is None or not os.path.isdir(path):
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(self.module, self.optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])


class FSDPBackend(ModelBackend):
    """PyTorch FSDP2 (`fully_shard`): weights, gradients and optimizer state sharded over the ranks."""

    Args = FSDPBackendArgs
    capabilities = frozenset({"train", "forward", "generate", "images"})

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        a: FSDPBackendArgs = self.args
        use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        _ensure_process_group(device)
        module = model.module
        if a.gradient_checkpointing and a.optimizer is not None:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(module, "config"):
            packing.set_attention(module, a.attn_implementation)
        architecture = type(module).__name__
        saved = saved_names(module)  # before fully_shard renames its class
        if a.lora is not None:
            module = with_lora(module, a.lora, model.seed)
        module = module.to(device)
        param_dtype, reduce_dtype = DTYPES[a.mixed_precision_param], DTYPES[a.mixed_precision_reduce]
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        mesh = init_device_mesh(device.type, (distributed.world(),))
        for layer in decoder_layers(module):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=a.reshard_after_forward)
        # The model's outputs (logits, values) come back in fp32 for the losses. The root's parameters
        # (embeddings, head) stay gathered from forward to backward (torch's own default for the root);
        # set explicitly, as the LM head's weight is used after the forward (`LMOutput`: the loss
        # computes log-probs from the hidden states and this gathered weight, chunk by chunk).
        root_mp = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32
        )
        fully_shard(module, mesh=mesh, mp_policy=root_mp, reshard_after_forward=False)
        model.module = FSDPEngine(
            module,
            device,
            a.optimizer,
            spec.total_train_steps,
            architecture,
            a.reshard_after_forward,
            saved,
            a.share_prompts,
        )
        model.device, model.dtype = device, param_dtype
        return model

    @property
    def resumes_weights(self) -> bool:
        """With LoRA, resume rebuilds the base and loads the adapters itself (`load`), not the merged export."""
        return self.args.lora is not None

    def destroy(self, model: Model) -> None:
        global _own_process_group
        if _own_process_group and distributed.initialized():
            dist.destroy_process_group()
        _own_process_group = False
