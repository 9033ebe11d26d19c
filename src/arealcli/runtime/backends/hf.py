"""The embedded backend: a transformers model in this process, on CPU or one GPU.

Under `areal train --nproc-per-node N` every rank holds a full replica: forward and generation run on
the rank's own slice, and a training step averages the gradients over the ranks before the (then
identical) optimizer step — plain replicated data parallelism. Only rank 0 writes checkpoints.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from arealcli.runtime import distributed, vision
from arealcli.runtime.backends import packing
from arealcli.runtime.backends.base import ModelBackend
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput
from arealcli.runtime.engines.train import TrainEngine, average_gradients, clip_and_step
from arealcli.runtime.generation import sampling as generation
from arealcli.runtime.models.lora import ADAPTER_DIR, is_lora, save_adapter_update, with_lora
from arealcli.runtime.models.lora import save_base as save_lora_base
from arealcli.runtime.models.model import DTYPES, FinetuneSpec, Model
from arealcli.runtime.models.weights import load_plain
from arealcli.runtime.optim import begin_step, build_optimizer, require_optimizer
from arealcli.runtime.vision import save_tokenizer
from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.engine import GenerationHyperparameters, OptimizerConfig
from arealcli.schema.registry import TEXT_CAPABILITIES


def run_packed(
    module, mb: SequenceSample, device, layout: str | None = None, share_prompts: bool = False
) -> torch.Tensor | LMOutput:
    """Forward a micro-batch of packed sequences; outputs in packed order (sample 0's tokens, then 1's...).

    Language models return an `LMOutput` (final hidden states and the LM head: no (tokens, vocab)
    logits are computed here), or packed logits (tokens, vocab) when the head is not a plain linear
    layer; value-head models return values (tokens,). `layout` (default: `choose_layout`): "packed"
    puts several sequences in each row with per-sequence position ids (block-diagonal causal
    attention, `backends.packing`), "padded" gives every sequence its own right-padded row. With
    `share_prompts` and no layout asked for, samples with the same prompt (a GRPO group, a preference
    pair) share one copy of it in a single row (`packing.shared_prompt_row`) where the model attends
    per sequence by our varlen SDPA: the same outputs for less work (rounded differently).
    """
    lens = mb.seqlens["packed_input_ids"]
    seeing = vision.is_vision(module)
    rows: list[list[int]] = []
    batch = None
    # a value-head model's decoder call takes no position ids: no shared prompts there
    shares = share_prompts and layout is None and not seeing and packing.takes_position_ids(module)
    if shares and packing.varlen_attention(module) == "sdpa":
        batch = shared_prompt_batch(mb)
    if batch is None:
        layout = layout or choose_layout(module, lens)
        rows = packing.rows_of(lens, layout, packing.row_capacity(module, lens))
        batch = packing.build_rows(
            mb.data["packed_input_ids"], lens, rows, with_positions=layout == "packed" or seeing
        )
    head = lm_head(module)
    with capture_head_input(head) as captured:
        kwargs: dict[str, Any] = {}
        if packing.takes_position_ids(module):
            kwargs["use_cache"] = False  # a KV cache would also turn off the packed-sequence mask
        if batch.position_ids is not None:
            kwargs["position_ids"] = batch.position_ids.to(device)
            if batch.blocks is not None:
                kwargs[packing.PREFIX_BLOCKS] = batch.blocks  # prompts shared by their samples
            elif packing.varlen_attention(module) == "sdpa" and batch.cu_seqlens:
                kwargs[packing.CU_SEQLENS] = batch.cu_seqlens  # attention within each sequence
        if seeing:
            kwargs.update(vision_inputs(module, mb, batch, rows, device))
        # No attention mask: with right padding the causal mask alone keeps every real token from seeing
        # the pads after it (the pads' own outputs are dropped), and SDPA keeps its fast causal kernel.
        # Packed rows: attention within each sequence (varlen), or transformers' block-diagonal causal
        # mask from the position ids.
        out = module(input_ids=batch.ids.to(device), **kwargs)
    index = batch.index.to(device)  # packed token n sits at flat position index[n] of the (R, T) rows
    if captured:
        hidden, weight, bias = captured[0]  # hidden (R, T, H)
        if seeing:  # the policy is over the tokens generation may write (placeholders excluded)
            bias = vision.placeholder_bias(module, weight, bias)
        return LMOutput(hidden.flatten(0, 1)[index], weight, bias)
    out = out.logits if hasattr(out, "logits") else out
    return out.flatten(0, 1)[index]


def shared_prompt_batch(mb: SequenceSample) -> packing.Rows | None:
    """The shared-prompt row of a micro-batch whose samples share prompts (the leading run of each
    sample's `prompt_mask`), or None when none do."""
    if "prompt_mask" not in mb.data or mb.bs < 2:
        return None
    prompt_lens = [int(m.bool().long().cumprod(0).sum()) for m in mb.unpack("prompt_mask")]
    lens = mb.seqlens["packed_input_ids"]
    ids = mb.data["packed_input_ids"].cpu()
    groups = packing.prompt_groups(ids, lens, prompt_lens)
    if len(groups) == len(lens):
        return None
    return packing.shared_prompt_row(ids, lens, prompt_lens, groups)


def generate_on(engine, module, prompts, g, eos_ids, pad_id, stop_texts, images):
    """`generation.generate` on `module` with an engine's device and its `share_prompts` (hf, fsdp)."""
    return generation.generate(
        module,
        prompts,
        g,
        eos_ids,
        pad_id,
        engine.device,
        stop_texts=stop_texts,
        images=images,
        share_prompts=engine.share_prompts,
    )


def vision_inputs(module, mb: SequenceSample, batch: packing.Rows, rows: list[list[int]], device) -> dict:
    """A vision-language model's forward keywords for the rows of `batch`: its images in the order their
    tokens appear in the rows, and (4, R, T) position ids: the per-sequence text positions (from which
    transformers builds a packed row's mask) over each sequence's own M-RoPE positions
    (`vision.positions`)."""
    assert batch.position_ids is not None
    images = vision.per_sample_images(mb)
    grids = [g for _, g in images] if images is not None else [None] * mb.bs
    mrope = torch.zeros(3, batch.ids.numel(), dtype=torch.long)
    per_seq = [
        vision.positions(module, ids.to(device), grid).cpu()
        for ids, grid in zip(mb.unpack("packed_input_ids"), grids, strict=True)
    ]
    mrope[:, batch.index] = torch.cat(per_seq, dim=1)
    out = {"position_ids": torch.cat([batch.position_ids[None], mrope.view(3, *batch.ids.shape)]).to(device)}
    if images is not None:
        out.update(vision.joined(images, [i for row in rows for i in row], device))
    return out


def choose_layout(module, lens: list[int]) -> str:
    """The rows' layout: packed for transformers models (their attention follows per-sequence position
    ids); padded where that has no padding (sequences of one length: one batched attention call) and
    for other modules (a value-head critic's decoder call takes no position ids)."""
    return "packed" if packing.takes_position_ids(module) and len(set(lens)) > 1 else "padded"


def lm_head(module) -> torch.nn.Linear | None:
    """The output embedding when it is a plain linear layer whose output the model returns as is
    (no logit scaling or soft-capping after it), else None."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not torch.nn.Linear:
        return None
    config = getattr(module, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            return None
    return head


@contextlib.contextmanager
def capture_head_input(head: torch.nn.Module | None):
    """While inside, `head`'s forward records its input (the final hidden states) with the weight and
    bias it uses (FSDP: the gathered ones) in the yielded list, and computes on an empty slice of the
    input instead: the model returns (B, 0, V) logits."""
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    if head is None:
        yield captured
        return

    def pre_hook(_module, args):
        captured.append((args[0], _module.weight, _module.bias))
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(pre_hook)
    try:
        yield captured
    finally:
        handle.remove()


class HFEngine(TrainEngine):
    """A transformers module in this process; replicas average their gradients over ranks."""

    def __init__(
        self,
        module: torch.nn.Module,
        device: torch.device,
        compute_dtype: torch.dtype,
        optimizer_cfg: OptimizerConfig | None,
        total_train_steps: int,
        share_prompts: bool = False,
    ):
        self.module: Any = module  # a transformers model, or peft's wrapper of one (duck-typed)
        self.device = device
        self.share_prompts = share_prompts
        self.compute_dtype = compute_dtype
        self.optimizer_cfg = optimizer_cfg
        self.total_train_steps = total_train_steps
        self.optimizer = build_optimizer(module.parameters(), optimizer_cfg) if optimizer_cfg else None

    def autocast(self):
        if self.compute_dtype == torch.float32 or next(self.module.parameters()).dtype == self.compute_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def run_microbatch(self, mb: SequenceSample) -> torch.Tensor | LMOutput:
        return run_packed(self.module, mb, self.device, share_prompts=self.share_prompts)

    def begin_train_step(self, version_steps: int, lr_scale: float) -> float:
        lr = begin_step(self.optimizer, self.optimizer_cfg, self.total_train_steps, version_steps, lr_scale)
        self.module.train()
        return lr

    def finish_train_step(self, stepped: bool) -> float:
        average_gradients(self.module.parameters())  # no-op in a single process
        # begin_train_step checked that there is an optimizer
        optimizer, cfg = require_optimizer(self.optimizer, self.optimizer_cfg)
        return clip_and_step(self.module.parameters(), optimizer, cfg.gradient_clipping)

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
        # with LoRA the adapters sit inside the base model's layers: generate with it directly
        module = self.module.get_base_model() if self.lora else self.module
        with self.autocast():
            return generate_on(self, module, prompts, g, eos_ids, pad_id, stop_texts, images)

    def save_to_hf(self, tokenizer, save_dir: str) -> None:
        """An HF directory `from_pretrained` loads; with LoRA, the merged weights (base + scaled B A) and
        the adapters themselves in `adapter/` (peft's format)."""
        if distributed.rank() != 0:  # the replicas are identical: rank 0 writes
            return
        os.makedirs(save_dir, exist_ok=True)
        if self.lora:
            import copy

            self.module.save_pretrained(os.path.join(save_dir, ADAPTER_DIR), safe_serialization=True)
            merged = copy.deepcopy(self.module).merge_and_unload()  # a copy: training goes on unmerged
            merged.save_pretrained(save_dir, safe_serialization=True)
        else:
            self.module.save_pretrained(save_dir, safe_serialization=True)
        if tokenizer is not None:
            save_tokenizer(tokenizer, save_dir)

    def save_base(self, save_dir: str) -> None:
        """LoRA: the base weights the adapters apply to (for servers that take adapter-only updates)."""
        if distributed.rank() == 0:
            save_lora_base(self.module, save_dir)

    def save_adapter_update(self, save_dir: str) -> None:
        """LoRA: the adapters alone, as an update to the base saved by `save_base` in the folder above."""
        if distributed.rank() == 0:
            save_adapter_update(self.module, save_dir)

    # ------------------------------------------------------------------ state

    def save_state(self, save_dir: str) -> None:
        if self.optimizer is not None and distributed.rank() == 0:
            torch.save({"optimizer": self.optimizer.state_dict()}, os.path.join(save_dir, "engine_state.pt"))

    def load_state(self, load_dir: str) -> None:
        if self.lora:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            adapters = load_file(os.path.join(load_dir, ADAPTER_DIR, "adapter_model.safetensors"))
            result = set_peft_model_state_dict(self.module, adapters)
            unexpected = getattr(result, "unexpected_keys", None)
            if unexpected:
                raise RuntimeError(f"adapters in {load_dir} do not fit the model: {unexpected[:5]}")
        path = os.path.join(load_dir, "engine_state.pt")
        if self.optimizer is not None and os.path.exists(path):
            state = load_plain(path, map_location=self.device)
            self.optimizer.load_state_dict(state["optimizer"])

    def update_weights(self, path: str, version: int) -> None:
        """Load another model's HF export in place (a model with `weights_from`)."""
        from pathlib import Path

        from arealcli.runtime.models.weights import load_hf_weights

        load_hf_weights(self.module, Path(path))

    def weights_in_memory(self, adapters_apart: bool = False):
        """This replica's weights under HF names, for a follower in this process (no copy)."""
        from arealcli.runtime.models.weights import weights_in_memory

        return weights_in_memory(self.module, adapters_apart)


class HFBackend(ModelBackend):
    """The embedded transformers backend: one process, CPU or one GPU."""

    Args = HFBackendArgs
    capabilities = TEXT_CAPABILITIES | {"images"}

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        a: HFBackendArgs = self.args
        device = torch.device(
            "cuda"
            if a.device == "auto" and torch.cuda.is_available()
            else ("cpu" if a.device == "auto" else a.device)
        )
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())  # the rank's GPU
        dtype = DTYPES[a.dtype]
        module = model.module
        if a.optimizer is None:
            module = module.to(dtype)  # inference only: keep weights in the compute dtype
        elif a.gradient_checkpointing:
            module.gradient_checkpointing_enable()
        if hasattr(module, "config"):
            packing.set_attention(module, a.attn_implementation)
        if a.lora is not None:
            module = with_lora(module, a.lora, model.seed)
        module = module.to(device)
        model.module = HFEngine(module, device, dtype, a.optimizer, spec.total_train_steps, a.share_prompts)
        model.device, model.dtype = device, dtype
        return model

    @property
    def resumes_weights(self) -> bool:
        """With LoRA, resume rebuilds the base and loads the adapters itself (`load`), not the merged export."""
        return self.args.lora is not None
