"""The explicit table of built-in components: name -> implementation (imported lazily) + its args model.

Call types are declared here so `areal check` knows what each interface implements without importing
it; a test checks this table against the classes themselves.
"""

from __future__ import annotations

from arealcli.schema.base import NoArgs
from arealcli.schema.components.backends import (
    FSDPBackendArgs,
    HFBackendArgs,
    MegatronBackendArgs,
    SGLangBackendArgs,
    VLLMBackendArgs,
)
from arealcli.schema.components.datasets import PromptAnswerArgs
from arealcli.schema.components.interfaces import PPOActorArgs, PPOCriticArgs, RewardArgs, SFTArgs
from arealcli.schema.registry import BACKENDS, DATASETS, INTERFACES, REWARDS, Entry

_R = "arealcli.runtime"


def _interface(name, target, args, description, call_types, needs_model=True):
    INTERFACES.add(Entry(name, target, args, description, "builtin", frozenset(call_types), needs_model))


_interface("sft", f"{_R}.interfaces.sft:SFTInterface", SFTArgs, SFTArgs.__doc__, ["train_step"])
_interface(
    "ppo_actor",
    f"{_R}.interfaces.ppo_actor:PPOActorInterface",
    PPOActorArgs,
    PPOActorArgs.__doc__,
    ["generate", "inference", "train_step"],
)
_interface(
    "ppo_critic",
    f"{_R}.interfaces.ppo_critic:PPOCriticInterface",
    PPOCriticArgs,
    PPOCriticArgs.__doc__,
    ["inference", "train_step"],
)
_interface(
    "reward",
    f"{_R}.interfaces.reward:RewardInterface",
    RewardArgs,
    RewardArgs.__doc__,
    ["inference"],
    needs_model=False,
)

for _name, _fn, _doc in [
    (
        "math",
        "math_reward",
        "1 if the final answer equals a reference (numeric/symbolic, with a timeout), else 0.",
    ),
    ("exact_match", "exact_match", "1 if the stripped response equals a stripped reference answer, else 0."),
]:
    REWARDS.add(Entry(_name, f"{_R}.rewards.builtin:{_fn}", NoArgs, _doc, "builtin"))

BACKENDS.add(Entry("hf", f"{_R}.backends.hf:HFBackend", HFBackendArgs, HFBackendArgs.__doc__, "builtin"))
BACKENDS.add(
    Entry(
        "sglang",
        f"{_R}.backends.sglang:SGLangBackend",
        SGLangBackendArgs,
        SGLangBackendArgs.__doc__,
        "builtin",
    )
)
BACKENDS.add(
    Entry("vllm", f"{_R}.backends.vllm:VLLMBackend", VLLMBackendArgs, VLLMBackendArgs.__doc__, "builtin")
)
BACKENDS.add(Entry("megatron", f"{_R}.backends.megatron.backend:MegatronBackend", MegatronBackendArgs, MegatronBackendArgs.__doc__, "builtin"))  # fmt: skip  # noqa: E501
BACKENDS.add(
    Entry("fsdp", f"{_R}.backends.fsdp:FSDPBackend", FSDPBackendArgs, FSDPBackendArgs.__doc__, "builtin")
)

PROMPT_ANSWER_KEYS = frozenset({"packed_input_ids", "prompt_mask", "packed_prompts", "prompt", "answers"})
DATASETS.add(
    Entry(
        "prompt_answer",
        f"{_R}.datasets:PromptAnswerDataset",
        PromptAnswerArgs,
        PromptAnswerArgs.__doc__,
        "builtin",
        data_keys=PROMPT_ANSWER_KEYS,
    )
)
