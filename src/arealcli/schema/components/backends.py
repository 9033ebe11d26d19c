"""Argument models of the built-in backends."""

from __future__ import annotations

from typing import ClassVar, Literal, TypedDict, TypeVar

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from arealcli.schema.base import NAME_PATTERN, StrictModel
from arealcli.schema.components.engine import LoraConfig, OptimizerConfig

Dtype = Literal["float32", "bfloat16", "float16"]

# Where a backend's compute runs, for `cpus` / `devices`: the training process itself, a thread of it,
# or the server processes it launches.
PlacementScope = Literal["process", "thread", "servers"]


def _distinct(ids: list[int] | None) -> list[int] | None:
    if ids is None:
        return None
    if not ids:
        raise ValueError("an empty list places nothing: give at least one id, or null (not placed)")
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"{', '.join(map(str, twice))} given twice")
    return ids


class Placement(StrictModel):
    """`cpus` and `devices`: the CPU cores and GPUs a backend's compute runs on (null: not placed).

    `placement_scope` says what they apply to: "process" (the training process: its threads, torch's
    thread count, its GPU), "thread" (a thread of the training process and the torch threads it starts),
    "servers" (the server processes the backend launches; several servers split the ids evenly).
    """

    placement_scope: ClassVar[PlacementScope] = "process"

    cpus: list[NonNegativeInt] | None = Field(
        None,
        description="CPU cores (ids as in `taskset`/`nproc`) this backend's compute runs on; null = any "
        "core this process may use.",
    )
    devices: list[NonNegativeInt] | None = Field(
        None,
        description="GPUs (indices among the visible ones) this backend runs on; null = the default.",
    )

    @field_validator("cpus", "devices")
    @classmethod
    def _ids(cls, ids: list[int] | None) -> list[int] | None:
        return _distinct(ids)


def share(ids: list[int], index: int, parts: int) -> list[int]:
    """Part `index` of `parts` contiguous, near-equal parts of `ids`; every part is all of `ids` when
    there are fewer ids than parts (then the parts share them)."""
    if len(ids) < parts:
        return list(ids)
    return ids[index * len(ids) // parts : (index + 1) * len(ids) // parts]


SHARE_PROMPTS = (
    "Compute a prompt its samples share (a GRPO group, a preference pair) once in training and log-prob "
    "forwards and prefill it once in generation: the same math for less work (sdpa attention; the float "
    "rounding differs from runs without it, so their numbers differ in the last bits and RL runs drift apart)."
)


class HFBackendArgs(Placement):
    """The embedded transformers backend: one process, CPU or one GPU."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when available, else cpu."
    )
    dtype: Dtype = Field("float32", description="Parameter and compute dtype.")
    optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer for trained models; null for inference-only models."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel.")
    lora: LoraConfig | None = Field(
        None, description="Train low-rank adapters instead of every weight (needs an optimizer)."
    )
    share_prompts: bool = Field(False, description=SHARE_PROMPTS)

    @model_validator(mode="after")
    def _lora_trains(self) -> HFBackendArgs:
        return _lora_needs_an_optimizer(self)


_WithLora = TypeVar("_WithLora", bound="HFBackendArgs | FSDPBackendArgs")


def _lora_needs_an_optimizer(args: _WithLora) -> _WithLora:
    if args.lora is not None and args.optimizer is None:
        raise ValueError("lora adapters are for training: add `optimizer: {lr: ...}` (or drop `lora`)")
    return args


class FSDPBackendArgs(Placement):
    """PyTorch FSDP2 (`fully_shard`): weights, gradients and optimizer state sharded over the ranks.

    Start it with `areal train RECIPE --nproc-per-node N`: gloo on CPU, NCCL on GPUs.
    """

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = the rank's GPU when available, else cpu (gloo)."
    )
    optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer for trained models; null for inference-only models."
    )
    mixed_precision_param: Dtype = Field(
        "float32",
        description="Compute dtype of the all-gathered parameters (bfloat16: fp32 master weights, "
        "bf16 forward/backward).",
    )
    mixed_precision_reduce: Dtype = Field(
        "float32", description="Dtype in which gradients are reduce-scattered over ranks."
    )
    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (re-gather in backward): less memory."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel.")
    lora: LoraConfig | None = Field(
        None, description="Train low-rank adapters instead of every weight (needs an optimizer)."
    )
    share_prompts: bool = Field(False, description=SHARE_PROMPTS)

    @model_validator(mode="after")
    def _lora_trains(self) -> FSDPBackendArgs:
        return _lora_needs_an_optimizer(self)


class MegatronBackendArgs(Placement):
    """Megatron-Core GPTModel with tensor / pipeline / data parallelism (launch with --nproc-per-node).

    Data parallelism takes the rest of the world: dp = world_size / (tensor_parallel_size *
    pipeline_parallel_size). Qwen2 / Llama causal LMs only.
    """

    tensor_parallel_size: PositiveInt = Field(
        1, description="Ranks one layer is split over (heads, MLP width, vocab)."
    )
    pipeline_parallel_size: PositiveInt = Field(
        1, description="Pipeline stages; num_hidden_layers must divide evenly over them."
    )
    dtype: Dtype = Field("float32", description="Parameter and compute dtype.")
    optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer for trained models; null for inference-only models."
    )
    attention: Literal["sdpa", "local"] = Field(
        "sdpa", description="Core attention: torch SDPA (fused kernels) or megatron's unfused local one."
    )
    use_distributed_optimizer: bool = Field(
        False, description="Shard optimizer state over data-parallel ranks (GPU only; ignored on CPU)."
    )
    make_vocab_size_divisible_by: PositiveInt = Field(
        128, description="Pad the vocab to a multiple of this times tensor_parallel_size."
    )


class LocalBackendArgs(Placement):
    """Generation in this process on a thread of its own: a copy of the model that follows another's
    weights (`weights_from`), batching the prompt groups it is sent. The engine of `areal serve`,
    without HTTP: for asynchronous RL on one machine without a server. New weights are copied in memory
    (LoRA: the adapters alone)."""

    placement_scope: ClassVar[PlacementScope] = "thread"

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when available, else cpu."
    )
    dtype: Dtype = Field("float32", description="Weights and compute dtype.")
    max_batch_size: PositiveInt = Field(
        1024, le=1 << 20, description="Most samples in one generate call (more wait for the next one)."
    )
    batch_window_ms: float = Field(
        5.0, ge=0, le=10_000, description="Batch the groups that arrive within this long of each other."
    )
    num_threads: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="torch CPU threads of the generation thread (0 = torch's default); the training thread "
        "keeps its own. null = one per core of `cpus` when placed, else 1 (the other cores to training).",
    )

    @field_validator("devices")
    @classmethod
    def _one_gpu(cls, devices: list[int] | None) -> list[int] | None:
        if devices is not None and len(devices) > 1:
            raise ValueError("the local generator runs on one GPU: give one device id")
        return devices

    def generation_threads(self) -> int:
        """torch threads of the generation thread (0: torch's default)."""
        if self.num_threads is not None:
            return self.num_threads
        return len(self.cpus) if self.cpus else 1


def _check_address(address: str) -> str:
    """`host:port` (an `http://` prefix is dropped): the port a number in 1..65535."""
    a = address.strip()
    a = a.removeprefix("http://").rstrip("/")
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host:
        raise ValueError(f"address {address!r} is not host:port (e.g. 127.0.0.1:30000)")
    if not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r}: port {port} is outside 1..65535")
    return a


class ServerFleetArgs(Placement):
    """What every server-backed generation backend shares: where the servers are, how to reach them.

    `cpus` and `devices` place the servers it launches (server i gets part i of each, `share`); servers
    given by `addresses` run elsewhere and are not placed.
    """

    placement_scope: ClassVar[PlacementScope] = "servers"
    gpus_per_server: ClassVar[str | None] = None  # the field that says how many GPUs one server uses

    addresses: list[str] = Field(
        default_factory=list,
        description="Running servers as host:port (connect mode; exclusive with launch).",
    )
    num_servers: PositiveInt = Field(1, description="Servers to launch (each on its own port and GPUs).")
    host: str = Field("127.0.0.1", description="Interface launched servers listen on.")
    base_port: int | None = Field(
        None,
        ge=1,
        lt=65536,
        description="Port of the first launched server (then +1, ...); null = free ports.",
    )
    extra_args: list[str] = Field(default_factory=list, description="Appended to each launch command.")
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for one generation request or weight-update answer."
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="Longest wait to connect to a server.")
    stall_timeout_s: float = Field(
        30.0,
        gt=0,
        le=86400,
        description="A server whose /health does not answer for this long while a request waits is given up "
        "(stuck: alive but not answering); the request moves to another server or fails.",
    )
    max_retries: int = Field(
        3, ge=0, description="Re-sends of a request after connection failures (to another server if any)."
    )
    retry_backoff_s: float = Field(0.5, ge=0, description="First backoff between retries; doubles each time.")
    max_concurrent_requests: PositiveInt = Field(256, description="Requests in flight at once, all servers.")
    max_restarts: NonNegativeInt = Field(
        3,
        description="A launched server that dies or hangs is restarted (same CPUs/GPUs, the newest weights) "
        "at most this many times within restart_window_s; once more ends the run. 0: never restarted.",
    )
    restart_window_s: float = Field(3600.0, gt=0, description="The window that max_restarts counts in.")
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Servers given by `addresses` that want a key: the name of the environment variable "
        "holding it (never the key itself in a recipe). Launched servers get a fresh key per run.",
    )
    reconnect_timeout_s: float = Field(
        60.0,
        ge=0,
        description="Servers given by `addresses`: when none answers, wait this long for one to come back "
        "(it then gets the newest weights) before the run ends.",
    )

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, addresses: list[str]) -> list[str]:
        return [_check_address(a) for a in addresses]

    def key(self) -> str | None:
        """The key for servers given by address (from `api_key_env`); an error when it is not set."""
        if self.api_key_env is None:
            return None
        import os

        from arealcli.errors import UserError

        value = os.environ.get(self.api_key_env)
        if not value:
            raise UserError(
                f"api_key_env: the environment variable {self.api_key_env} (the servers' API key) is not set"
            )
        return value

    def server_cpus(self, index: int) -> list[int] | None:
        """The cores of launched server `index`."""
        return None if self.cpus is None else share(self.cpus, index, self.num_servers)

    def server_devices(self, index: int) -> list[int] | None:
        """The GPUs of launched server `index`."""
        return None if self.devices is None else share(self.devices, index, self.num_servers)

    def _placement_fits(self) -> None:
        """Placement is for launched servers; each server's share of `devices` holds its GPUs."""
        if self.addresses and (self.cpus is not None or self.devices is not None):
            raise ValueError(
                "`cpus` / `devices` place servers started here (`launch`); servers given by `addresses` run "
                "where they were started"
            )
        if self.devices is None:
            return
        per = getattr(self, self.gpus_per_server) if self.gpus_per_server else 1
        if len(self.devices) != self.num_servers * per:
            raise ValueError(
                f"devices: {self.num_servers} server(s) x {per} GPU(s) each need {self.num_servers * per} "
                f"device ids, {len(self.devices)} given"
            )

    def client_options(self) -> ClientOptions:
        """Keyword arguments of the generation client built from these settings."""
        return {
            "request_timeout_s": self.request_timeout_s,
            "connect_timeout_s": self.connect_timeout_s,
            "stall_timeout_s": self.stall_timeout_s,
            "max_retries": self.max_retries,
            "retry_backoff_s": self.retry_backoff_s,
            "max_concurrent_requests": self.max_concurrent_requests,
            "reconnect_timeout_s": self.reconnect_timeout_s,
        }


class ClientOptions(TypedDict):
    """`ServerFleetArgs.client_options`: keyword arguments of a generation client."""

    request_timeout_s: float
    connect_timeout_s: float
    stall_timeout_s: float
    max_retries: int
    retry_backoff_s: float
    max_concurrent_requests: int
    reconnect_timeout_s: float


class SGLangBackendArgs(ServerFleetArgs):
    """Generation on SGLang servers over their native HTTP protocol: connect to `addresses` or `launch` them."""

    gpus_per_server: ClassVar[str | None] = "tp_size"

    launch: Literal["sglang", "embedded"] | None = Field(
        None,
        description="Start servers here: sglang = `python -m sglang.launch_server` (GPU); "
        "embedded = `areal serve` (our own, CPU or GPU).",
    )
    tp_size: PositiveInt = Field(1, description="Tensor-parallel GPUs per launched SGLang server.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype of launched servers (auto: SGLang's choice; float32 for embedded)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device of embedded servers.")
    mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, description="SGLang --mem-fraction-static (GPU memory for weights + KV cache)."
    )
    context_length: PositiveInt | None = Field(
        None, description="SGLang --context-length; null = the model's."
    )
    python: str | None = Field(
        None, description="Python interpreter that has sglang installed (launch: sglang); default: this one."
    )
    startup_timeout_s: float = Field(600.0, gt=0, description="Wait this long for launched servers' /health.")
    max_abort_resends: int = Field(
        8, ge=0, description="Re-sends of a sample aborted by weight updates before it is an error."
    )
    abort_on_update: bool = Field(
        True, description="Abort in-flight requests on a weight update (they are re-sent) instead of waiting."
    )
    lora_updates: Literal["adapters", "merged"] = Field(
        "adapters",
        description="Following a LoRA model on launched embedded servers: send its base once and then the "
        "adapters alone (the servers merge them into their copy of the base), or the merged weights every "
        "time. Other servers always get merged weights.",
    )
    lora_name: str | None = Field(
        None,
        description="Following a LoRA model on servers given by `addresses`: serve its adapter there under "
        "this name, beside the base weights they hold and the adapters of other runs or policies; every "
        "update loads the new adapter by name (/load_lora_adapter, adapters only) and every request asks "
        "for it. The servers must hold the LoRA model's base (`areal serve --model BASE`).",
    )

    @model_validator(mode="after")
    def _one_mode(self) -> SGLangBackendArgs:
        if self.lora_name is not None and self.launch is not None:
            raise ValueError(
                "lora_name serves an adapter on servers given by `addresses` (which other runs may share); "
                "launched servers follow a LoRA model by adapters alone already (lora_updates: adapters)"
            )
        if self.lora_name is not None and not NAME_PATTERN.match(self.lora_name):
            raise ValueError(f"lora_name {self.lora_name!r}: use letters, digits and _ . - (at most 100)")
        if bool(self.addresses) == (self.launch is not None):
            raise ValueError(
                "give either `addresses` (servers already running) or `launch: sglang|embedded` "
                "(start them here), not both and not neither"
            )
        self._placement_fits()
        return self


class VLLMBackendArgs(ServerFleetArgs):
    """Generation on vLLM servers over their OpenAI-compatible HTTP API: connect to `addresses` or `launch`.

    Weight updates (`weights_from`) use vLLM's development endpoints: start connected servers with
    `VLLM_SERVER_DEV_MODE=1` and `--logprobs-mode processed_logprobs` (launched servers get both).
    """

    gpus_per_server: ClassVar[str | None] = "tensor_parallel_size"

    launch: bool = Field(
        False, description="Start servers here with `python -m vllm.entrypoints.openai.api_server`."
    )
    python_executable: str | None = Field(
        None,
        description="Python interpreter that has vllm installed (launch); default: env AREALCLI_VLLM_PYTHON, "
        "else `python`.",
    )
    tensor_parallel_size: PositiveInt = Field(1, description="GPUs per launched server (vLLM -tp).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and compute dtype of launched servers (vLLM --dtype)."
    )
    max_model_len: PositiveInt | None = Field(
        None, description="Longest prompt + generation in tokens (vLLM --max-model-len); null = the model's."
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of GPU memory (of host memory on CPU) for weights + KV cache; null = vLLM's.",
    )
    kv_cache_memory_bytes: PositiveInt | None = Field(
        None,
        description="KV cache size in bytes (vLLM --kv-cache-memory-bytes); set it on CPU, where vLLM "
        "otherwise reserves most of the host memory.",
    )
    lora_updates: Literal["adapters", "merged"] = Field(
        "adapters",
        description="Following a LoRA model on launched servers: start them with vLLM's LoRA support "
        "(--enable-lora) and send the adapters alone, reloaded in place under the model's name (the base "
        "stays), or the merged weights every time. Servers given by `addresses` always get merged weights.",
    )
    enforce_eager: bool = Field(
        False, description="No CUDA graphs / torch.compile: faster start, slower decode (set true on CPU)."
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, description="Wait this long for launched servers' /health and first generation."
    )

    @model_validator(mode="after")
    def _one_mode(self) -> VLLMBackendArgs:
        if bool(self.addresses) == self.launch:
            raise ValueError(
                "give either `addresses` (servers already running) or `launch: true` (start them here), "
                "not both and not neither"
            )
        self._placement_fits()
        return self
