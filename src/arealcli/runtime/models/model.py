"""`Model`: a named module plus its tokenizer and version; and how models are built from a recipe."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from arealcli.errors import UserError
from arealcli.runtime.models.value_head import CausalLMWithValueHead, load_value_head_model, with_value_head
from arealcli.schema.recipe import ModelArchConfig, ModelSpec


@dataclass
class ModelVersion:
    epoch: int = 0
    epoch_step: int = 0
    global_step: int = 0


@dataclass
class FinetuneSpec:
    """What a backend needs to know about the run to size its LR schedule."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int
    total_train_steps: int
    run_dir: str | None = None  # where backends put what they write (server logs, exported weights)


@dataclass
class ModelSource:
    """How a model's weights are made, for a backend that builds its own (`builds_weights`): its spec
    (local paths resolved) and `build()`, the transformers module as the recipe describes it (seeded,
    built afresh on every call)."""

    spec: ModelSpec
    build: Callable[[], Any]


@dataclass
class Model:
    """A model of the run. `module` is the raw torch module until a backend turns it into an engine
    (None for a backend that builds its own weights from `source`)."""

    name: str
    module: Any
    tokenizer: Any
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    version: ModelVersion = field(default_factory=ModelVersion)
    backend: Any = None
    seed: int = 0  # seeds what a backend adds to the module (LoRA adapters): the same on every rank
    source: ModelSource | None = None

    def initial_module(self) -> Any:
        """Before a backend initializes the model: the torch module given, else one built from `source`."""
        if self.module is not None:
            return self.module
        if self.source is None:
            raise ValueError(f"model {self.name}: neither a module nor a source to build one from")
        return self.source.build()

    def inc_version(self) -> None:
        self.version.global_step += 1
        self.version.epoch_step += 1


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config_from_arch(arch: ModelArchConfig, tokenizer) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    if arch.family == "qwen2_vl":
        return vision_config_from_arch(arch, tokenizer)
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch.family]
    return cls(**text_config_args(arch, tokenizer))


def text_config_args(arch: ModelArchConfig, tokenizer) -> dict[str, Any]:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        intermediate_size=arch.intermediate_size,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=getattr(tokenizer, "bos_token_id", None),
    )


def vision_config_from_arch(arch: ModelArchConfig, tokenizer) -> Any:
    """A Qwen2-VL config: the language model of `arch` with M-RoPE (its rotary dimensions split over
    time, height and width as Qwen2-VL splits them, 1 : 1.5 : 1.5), the vision tower of `arch.vision`, and
    the tokenizer's vision tokens."""
    from transformers import Qwen2VLConfig

    from arealcli.runtime.vision import VISION_TOKENS
    from arealcli.schema.recipe import VisionArchConfig

    v = arch.vision or VisionArchConfig()
    half = arch.hidden_size // arch.num_attention_heads // 2
    t = half // 4
    h = (half - t) // 2
    text = text_config_args(arch, tokenizer)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": arch.rope_theta,
        "mrope_section": [t, h, half - t - h],
    }
    del text["rope_theta"]
    start, end, pad = (tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS)
    return Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=v.depth,
            embed_dim=v.embed_dim,
            hidden_size=arch.hidden_size,
            num_heads=v.num_heads,
            mlp_ratio=v.mlp_ratio,
            patch_size=v.patch_size,
            spatial_merge_size=v.spatial_merge_size,
        ),
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=arch.tie_word_embeddings,
    )


def build_module(spec: ModelSpec, tokenizer, seed: int, source_module=None):
    """The transformers module of one model spec (fp32, on CPU; the backend moves and casts it)."""

    if spec.init_from is not None:
        import copy

        module = copy.deepcopy(source_module)
    elif spec.path is not None:
        try:
            module = _from_pretrained(spec, seed)
        except (OSError, ValueError, KeyError) as e:  # no weights, an unknown architecture, no network ...
            from arealcli.schema.paths import REPO_ID, hub_cache_dir

            where = (
                f" (not a local directory, not in the Hugging Face cache {hub_cache_dir()}, and not "
                "downloadable here: fetch it with `huggingface-cli download` where there is a network)"
                if REPO_ID.match(spec.path)
                else ""
            )
            raise UserError(
                f"cannot load a model from {spec.path}{where}: {str(e).strip().splitlines()[0]}"
            ) from None
    else:
        assert spec.config is not None  # a model has exactly one source (ModelSpec): here, its config
        config = hf_config_from_arch(spec.config, tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = auto_class(config).from_config(config)
    if spec.value_head and not isinstance(module, CausalLMWithValueHead):
        module = with_value_head(module, seed)
    if spec.value_head:  # its score is read at the last token that is not the tokenizer's pad token
        module.config.pad_token_id = tokenizer.pad_token_id
    return module


def _from_pretrained(spec: ModelSpec, seed: int):
    """A model folder (or Hub name) as a causal LM, or with a value head: a saved classifier's trained
    one (a reward model), else a fresh one."""
    assert spec.path is not None
    if spec.value_head:
        return load_value_head_model(spec.path, seed)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.path)
    return auto_class(config).from_pretrained(spec.path, dtype=torch.float32)


def auto_class(config) -> Any:
    """The transformers auto class that builds a model of `config`: image-text-to-text for a
    vision-language model, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return (
        AutoModelForImageTextToText
        if getattr(config, "vision_config", None) is not None
        else AutoModelForCausalLM
    )


class BaseModelView:
    """Another model's engine with its LoRA adapters switched off: its base weights, shared (no copy).
    Runs forward passes and generation (e.g. the reference log-probs of an RL run with LoRA)."""

    def __init__(self, engine):
        self.engine = engine

    def _off(self):
        return self.engine.adapters_off()

    def forward(self, *args, **kwargs):
        with self._off():
            return self.engine.forward(*args, **kwargs)

    def generate(self, *args, **kwargs):
        with self._off():
            return self.engine.generate(*args, **kwargs)

    def eval_batch(self, *args, **kwargs):
        with self._off():
            return self.engine.eval_batch(*args, **kwargs)


class _ViewBackend:
    """What the trainer needs of a backend for a view: nothing to save, load or release."""

    capabilities = frozenset({"forward", "generate"})

    def save(self, model, save_dir) -> None: ...
    def load(self, model, load_dir) -> None: ...
    def destroy(self, model) -> None: ...


def base_model_view(name: str, source: Model) -> Model:
    model = Model(name, BaseModelView(source.module), source.tokenizer, source.device, source.dtype)
    model.backend = _ViewBackend()
    return model
