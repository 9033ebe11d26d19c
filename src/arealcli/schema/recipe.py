"""The recipe: a pydantic model of the whole YAML file."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from arealcli.schema.base import (
    Abstraction,
    ModelBackendAbstraction,
    ModelInterfaceAbstraction,
    Name,
    StrictModel,
)
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.registry import INTERFACES


class VisionArchConfig(StrictModel):
    """The vision tower of a `qwen2_vl` model built from a config (Qwen2-VL's ViT and patch merger)."""

    depth: PositiveInt = Field(2, le=128, description="Vision transformer layers.")
    embed_dim: PositiveInt = Field(64, le=1 << 14, description="Width of the vision transformer.")
    num_heads: PositiveInt = Field(2, le=256, description="Vision attention heads.")
    mlp_ratio: PositiveInt = Field(2, le=16, description="Vision MLP width / embed_dim.")
    patch_size: PositiveInt = Field(14, le=64, description="Pixels per patch side.")
    spatial_merge_size: PositiveInt = Field(
        2, le=8, description="Patches merged per side into one image token (merge^2 patches per token)."
    )
    max_pixels: PositiveInt = Field(
        224 * 224, description="Larger images are scaled down to at most this many pixels."
    )

    @model_validator(mode="after")
    def _heads(self) -> VisionArchConfig:
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) / num_heads ({self.num_heads}) must be a multiple of 4"
            )
        return self


class ModelArchConfig(StrictModel):
    """Build a model from an architecture config instead of loading weights (debugging, quickstarts)."""

    family: Literal["qwen2", "llama", "qwen2_vl"] = Field(
        "qwen2", description="Architecture family (qwen2_vl: Qwen2-VL, a vision-language model)."
    )
    hidden_size: PositiveInt = Field(64, le=1 << 16, description="Width of the residual stream.")
    num_hidden_layers: PositiveInt = Field(2, le=1024, description="Transformer layers.")
    num_attention_heads: PositiveInt = Field(4, le=1024, description="Query heads.")
    num_key_value_heads: PositiveInt = Field(2, le=1024, description="Key/value heads (GQA).")
    intermediate_size: PositiveInt = Field(256, le=1 << 18, description="MLP width.")
    max_position_embeddings: PositiveInt = Field(1024, le=1 << 22, description="Longest sequence, in tokens.")
    rope_theta: float = Field(10000.0, gt=0, description="Rotary embedding base.")
    tie_word_embeddings: bool = Field(True, description="Share input and output embeddings.")
    vision: VisionArchConfig | None = Field(
        None, description="The vision tower (family qwen2_vl; defaults when omitted)."
    )

    @model_validator(mode="after")
    def _heads(self) -> ModelArchConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.vision is not None and self.family != "qwen2_vl":
            raise ValueError(f"`vision` is for family qwen2_vl, not {self.family}")
        if self.family == "qwen2_vl" and (self.hidden_size // self.num_attention_heads) % 8:
            raise ValueError(
                f"qwen2_vl: hidden_size / num_attention_heads ({self.hidden_size // self.num_attention_heads}) "
                "must be a multiple of 8 (its rotary dimensions are split over time, height and width)"
            )
        return self


class TokenizerSpec(StrictModel):
    """Where the tokenizer comes from."""

    kind: Literal["hf", "char"] = Field(
        "hf", description="hf = load from `path`; char = built-in character-level tokenizer (no download)."
    )
    path: str | None = Field(None, description="Local HF tokenizer directory or Hub name (kind: hf).")
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template to use (replacing the tokenizer's own); needed for chat data with "
        "the char tokenizer, which has none.",
    )

    @model_validator(mode="after")
    def _path_for_hf(self) -> TokenizerSpec:
        if self.kind == "hf" and not self.path:
            raise ValueError("a tokenizer of kind 'hf' needs a `path`; or use kind: char")
        return self


class ModelSpec(StrictModel):
    """One model of the run: where its weights come from and which backend runs it."""

    path: str | None = Field(None, description="Local HF model directory to load.")
    config: ModelArchConfig | None = Field(None, description="Build from this config with random weights.")
    init_from: str | None = Field(
        None,
        description="Start from another model of this recipe (after its own loading), e.g. ref <- actor.",
    )
    weights_from: str | None = Field(
        None,
        description="Follow a trained model's weights: loaded into this one after every step that trains it "
        "(e.g. generation servers of the actor).",
    )
    follow_until: PositiveInt | None = Field(
        None,
        description="With `weights_from`: follow the source through its version (trained steps) N, then keep "
        "those weights, saved in checkpoints: e.g. a reference model that is the actor as an SFT warm-up of "
        "N steps left it (`ref: {init_from: actor, weights_from: actor, follow_until: N}`).",
    )
    base_of: str | None = Field(
        None,
        description="The base model under another model's LoRA adapters (adapters off), sharing its memory: "
        "e.g. the reference model of an RL run with LoRA (`ref: {base_of: actor}`).",
    )
    value_head: bool = Field(False, description="Replace the LM head by a scalar value head (critics).")
    backend: ModelBackendAbstraction = Field(
        default_factory=lambda: ModelBackendAbstraction(type_="hf"), description="Backend running this model."
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        sources = [s for s in ("path", "config", "init_from", "base_of") if getattr(self, s) is not None]
        if len(sources) != 1:
            raise ValueError(
                "a model needs exactly one of `path` (HF directory), `config` (build from config), "
                f"`init_from` (another model of the recipe) or `base_of` (a LoRA model's base); got {sources or 'none'}"
            )
        if self.follow_until is not None and self.weights_from is None:
            raise ValueError("follow_until needs weights_from: the model whose weights it follows until then")
        return self


class DatasetSpec(Abstraction):
    """A registered dataset, and how it is batched."""

    batch_size: PositiveInt = Field(le=1 << 24, description="Prompts (or samples) per training step.")
    shuffle: bool = Field(True, description="Reshuffle every epoch (seeded: the order is reproducible).")


class CallSpec(StrictModel):
    """One model function call (MFC) of the dataflow graph."""

    name: Name = Field(description="Unique name of the call (used in logs and timings).")
    model: str | None = Field(
        description="Model it runs on (null for weightless interfaces such as rule rewards)."
    )
    interface: ModelInterfaceAbstraction = Field(description="Interface implementing the call.")
    type: Literal["generate", "inference", "train_step"] = Field(
        description="Which interface method to call."
    )
    inputs: list[str] = Field(default_factory=list, description="Data keys consumed.")
    outputs: list[str] = Field(default_factory=list, description="Data keys produced.")
    output_key_remap: dict[str, str] = Field(
        default_factory=dict, description="Rename produced keys, e.g. {packed_logprobs: packed_ref_logprobs}."
    )
    mb_spec: MicroBatchSpec = Field(default_factory=MicroBatchSpec, description="Micro-batch split.")
    start_step: NonNegativeInt = Field(0, description="First training step (0-based) at which the call runs.")
    end_step: PositiveInt | None = Field(
        None, description="The call runs before this step only; null = always."
    )


def on_rollout_side(call: CallSpec) -> bool:
    """Generate calls and weightless inference calls (rewards) make rollouts; the rest trains, and so do
    weightless interfaces that keep training state (`returns`: its KL controller follows the trainer)."""
    if call.type == "generate":
        return True
    if call.type != "inference" or call.model is not None:
        return False
    entry = INTERFACES.find(call.interface.type_)
    return entry is None or not entry.training_side


class DataflowSpec(StrictModel):
    """The algorithm as a graph of model calls; edges follow from input/output keys.

    Write `calls` out, or name a `preset` (sft, grpo, ppo, distill) that expands to them (`areal check --print`
    shows the expansion).
    """

    calls: list[CallSpec] = Field(min_length=1, description="Model function calls, in a valid order.")


class WandbSpec(StrictModel):
    """Weights & Biases tracking (needs `pip install arealcli[wandb]`)."""

    project: str = Field("arealcli", description="W&B project.")
    name: str | None = Field(None, description="Run name; default: the experiment name.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="offline writes <run>/wandb for a later `wandb sync`."
    )
    tags: list[str] = Field(default_factory=list, description="Run tags.")


class EvalSamplesSpec(StrictModel):
    """Held-out evaluation with samples, beside the greedy score: n samples per prompt, reported as
    `eval/avg@k` and, for a 0/1 reward, `eval/pass@k` (unbiased estimator) and `eval/maj@k`."""

    n: PositiveInt = Field(description="Samples per held-out prompt.", le=1024)
    k: list[PositiveInt] | None = Field(None, description="The k of avg@k, pass@k, maj@k (default: 1 and n).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    seed: NonNegativeInt = Field(
        0, description="Seed of the evaluation samples (the training stream is untouched)."
    )

    @model_validator(mode="after")
    def _k_within_n(self) -> EvalSamplesSpec:
        bad = [k for k in self.k or [] if k > self.n]
        if bad:
            raise ValueError(f"k {bad} above n={self.n}: pass@k draws k of the n samples")
        return self

    def ks(self) -> list[int]:
        return sorted(set(self.k)) if self.k else sorted({1, self.n})


class RecoverSpec(StrictModel):
    """Automatic recovery: a failed run starts again from its last complete checkpoint, like `--resume`
    typed by hand. Not retried: bad input (exit 2), a loss that is not finite, a failure before the first
    checkpoint, the same failure again from the same checkpoint (a deterministic bug)."""

    mode: Literal["auto", "off"] = Field(
        "auto", description="auto: recover by itself; off: stop and say how to resume."
    )
    retries: NonNegativeInt = Field(3, description="Recoveries at most, per `areal train` command.")


class TrainerSpec(StrictModel):
    """The training loop: how long, and how often to log, evaluate and save."""

    total_train_epochs: PositiveInt = Field(1, le=1 << 20, description="Passes over the dataset.")
    max_steps: PositiveInt | None = Field(
        None,
        le=1 << 30,
        description="Train this many steps, cycling over epochs (overrides total_train_epochs).",
    )
    log_every_n_steps: PositiveInt = Field(1, description="Console/JSONL logging interval.")
    save_every_n_steps: PositiveInt | None = Field(
        None, description="Checkpoint interval; always saves at the end."
    )
    keep_last_n_checkpoints: PositiveInt = Field(2, description="Older checkpoints are deleted.")
    eval_every_n_steps: PositiveInt | None = Field(
        None, description="Evaluation interval (needs eval_dataset)."
    )
    eval_at_start: bool = Field(False, description="Evaluate before the first step too.")
    samples_every_n_steps: PositiveInt | None = Field(
        None, description="Write generated samples to <run>/samples/step_N.jsonl at this interval."
    )
    tensorboard: bool = Field(True, description="Also write TensorBoard events (<run>/tensorboard).")
    wandb: WandbSpec | None = Field(None, description="Also log to Weights & Biases.")
    console_metrics: list[str] | None = Field(
        None,
        description="Metric keys shown on the progress line (e.g. actor_train/reward, eval/accuracy); "
        "default: each training call's reward or loss and its held-out score.",
    )
    threads: PositiveInt | Literal["auto", "adaptive"] = Field(
        "auto",
        description="torch CPU threads of the training process. auto: the cores it may use (affinity, "
        "cgroup quota, placed cpus), fixed for the run, so other load slows it but never changes its "
        "results (a resume keeps the count); adaptive: follow the cores other processes leave free "
        "(re-measured every 5 s); N: exactly N. OMP_NUM_THREADS, when set, wins.",
    )
    eval: EvalSamplesSpec | None = Field(
        None,
        description="Also sample at held-out evaluation: {n: 8, k: [1, 8], temperature: 1.0} logs eval/avg@k, "
        "eval/pass@k, eval/maj@k beside the greedy score (ppo_actor calls).",
    )
    recover: RecoverSpec = Field(
        default_factory=RecoverSpec,
        description="What `areal train` does when training fails (a crashed process, a reward function "
        "raising, generation servers given up): restart from the last checkpoint by itself.",
    )
    permissions: Literal["private", "group"] = Field(
        "private",
        description="Who may read what the run writes (checkpoints, samples, logs, recipe.yaml, "
        "commands.log). private: you alone (the run directory and its folders 0700, files 0600); group: "
        "your group too, read-only (0750 and 0640), for a team folder. Applied as the umask of `areal "
        "train`, so its workers and launched servers write the same way.",
    )


class RolloutSpec(StrictModel):
    """Asynchronous RL: generation (and rewards) run ahead of training, on a generation model.

    The rollout side (generate calls, and the weightless inference calls such as rewards) produces
    step batches on a background thread into a bounded buffer; the training side (inference and
    train_step calls on trained models) takes them in order. The batch of step s may start generating
    once the weights after step s - K are published, so no sample trains more than K versions after the
    policy that started it. K = 0 is synchronous RL (same results as without this section).
    """

    max_staleness: NonNegativeInt = Field(
        le=1000, description="K: policy versions a batch may lag behind the trainer (0 = synchronous)."
    )


TRAINER = "trainer"  # the `cluster.allocation` key of the trainer ranks (the others name models)


class SlurmSpec(StrictModel):
    """`areal train --launcher slurm`: what the sbatch script asks Slurm for."""

    partition: str | None = Field(None, description="sbatch --partition; null: the cluster's default.")
    account: str | None = Field(None, description="sbatch --account.")
    time: str | None = Field(
        None,
        pattern=r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$",
        description="sbatch --time, e.g. 04:00:00 or 1-00:00:00; null: the partition's limit.",
    )
    sbatch_args: list[str] = Field(
        default_factory=list, description="More sbatch options, one per item, e.g. --qos=high."
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines run at the top of the job script, e.g. `module load cuda` or "
        "`source venv/bin/activate`.",
    )
    stop_grace_s: PositiveInt = Field(
        300,
        description="Stop the trainer (SIGTERM) this long before the time limit: it stops cleanly, keeping "
        "its last checkpoint, and says the command that continues.",
    )


class ClusterSpec(StrictModel):
    """Where a multi-node run goes: how many nodes, what each has, and which servers run on which.

    Used by `areal train --launcher slurm|ray` (the local launcher ignores it). `allocation` maps
    `trainer` and the names of server-backed generation models (sglang or vllm with `launch`) to node
    indices 0..nodes-1: those servers are started on their nodes by the launcher, in their own job
    step or Ray actor, and the trainer connects to them by address. Unlisted: the trainer ranks go on
    every node no server was given (every node when servers have them all); other launched servers are
    started by the trainer, as on one machine.
    """

    nodes: PositiveInt | None = Field(
        None, le=4096, description="Nodes of the job; default: --nnodes, else what the allocation names."
    )
    cpus_per_node: PositiveInt | None = Field(None, description="CPU cores asked for on each node.")
    gpus_per_node: NonNegativeInt = Field(0, le=64, description="GPUs asked for on each node.")
    allocation: dict[str, list[NonNegativeInt]] = Field(
        default_factory=dict,
        description="Node indices of `trainer` and of generation models' servers, e.g. "
        "{actor_gen: [0], trainer: [1]}.",
    )
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="Slurm job settings.")

    @model_validator(mode="after")
    def _nodes_exist(self) -> ClusterSpec:
        for key, ids in self.allocation.items():
            if not ids:
                raise ValueError(f"allocation.{key}: give at least one node index")
            if len(set(ids)) != len(ids):
                raise ValueError(f"allocation.{key}: node {ids} named twice")
            if self.nodes is not None and max(ids) >= self.nodes:
                raise ValueError(
                    f"allocation.{key}: node {max(ids)} does not exist in a {self.nodes}-node job "
                    f"(nodes are 0..{self.nodes - 1})"
                )
        return self


class Recipe(StrictModel):
    """A whole training recipe."""

    experiment: Name = Field(
        description="Name of the run: one directory name (runs/<experiment>), letters, digits, _ . -"
    )
    seed: NonNegativeInt = Field(1, description="Seed for weights, data order and sampling.")
    output_dir: str | None = Field(None, description="Run directory; default runs/<experiment>.")
    imports: list[str] = Field(default_factory=list, description="Python modules to import (user plugins).")
    tokenizer: TokenizerSpec | None = Field(
        None, description="Tokenizer; default: the one in the first model's `path`."
    )
    models: dict[Name, ModelSpec] = Field(min_length=1, description="Models by name.")
    dataset: DatasetSpec = Field(description="Training data.")
    eval_dataset: DatasetSpec | None = Field(None, description="Held-out data for evaluation.")
    dataflow: DataflowSpec = Field(description="The algorithm's model calls.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Loop settings.")
    rollout: RolloutSpec | None = Field(
        None, description="Asynchronous rollout (generation ahead of training); absent = synchronous."
    )
    cluster: ClusterSpec | None = Field(
        None, description="Multi-node placement for `areal train --launcher slurm|ray`."
    )

    @model_validator(mode="after")
    def _tokenizer_known(self) -> Recipe:
        if self.tokenizer is None and not any(m.path for m in self.models.values()):
            raise ValueError(
                "no tokenizer: set `tokenizer:` ({kind: char}, or {path: DIR}) or give a model a `path` "
                "whose directory has one"
            )
        return self
