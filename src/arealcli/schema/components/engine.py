"""Engine-level settings shared by every backend: optimizer, micro-batches, generation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from arealcli.schema.base import StrictModel


class OptimizerConfig(StrictModel):
    """AdamW with a warmup + decay learning-rate schedule and gradient clipping."""

    type: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Decay after warmup, over the run's training steps (one schedule step per trainer step, "
        "whatever the number of minibatches in it).",
    )
    warmup_steps_proportion: float = Field(
        0.0, ge=0, le=1, description="Fraction of steps spent in linear warmup."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a fraction of `lr`.")
    gradient_clipping: float | None = Field(
        1.0, gt=0, description="Max global grad norm; null disables clipping."
    )


class LoraConfig(StrictModel):
    """Low-rank adapters (LoRA, with peft): only the adapters train and carry optimizer state."""

    rank: PositiveInt = Field(8, le=4096, description="Rank r of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(16.0, gt=0, description="Scale: the update is (alpha / rank) * B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Linear layers to adapt, by name suffix (e.g. [q_proj, v_proj]); all-linear = every "
        "linear layer but the output head.",
    )


class MicroBatchSpec(StrictModel):
    """How a batch is split into micro-batches: by a token budget, with at least `n_mbs` of them."""

    n_mbs: PositiveInt = Field(1, le=1 << 20, description="Minimum number of micro-batches.")
    max_tokens_per_mb: PositiveInt | None = Field(
        None, description="Token budget per micro-batch (first-fit-decreasing packing); null = no budget."
    )


MAX_SAMPLES_PER_PROMPT = 4096


class GenerationHyperparameters(StrictModel):
    """Sampling settings for generation."""

    n: PositiveInt = Field(1, le=MAX_SAMPLES_PER_PROMPT, description="Samples per prompt.")
    max_new_tokens: PositiveInt = Field(16, le=1 << 22, description="Maximum generated tokens per sample.")
    min_new_tokens: int = Field(0, ge=0, description="Minimum generated tokens (EOS suppressed before).")
    greedy: bool = Field(False, description="Greedy decoding (ignores temperature/top_p/top_k).")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra token ids that end a sample.")
    stop: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="Texts that end a sample (may span several tokens): it keeps every token up to the one "
        "that completes the text.",
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> GenerationHyperparameters:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens});"
                " lower min_new_tokens or raise max_new_tokens"
            )
        return self
