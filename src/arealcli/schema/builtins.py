"""The explicit table of built-in components: name -> implementation (imported lazily) + its args model.

Call types and what each interface is (a critic, a language model, ...) are declared here so `areal
check` knows them without importing it; a test checks this table against the classes themselves. Loaded
once, with the `arealcli.schema` package.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel

from arealcli.schema.base import NoArgs
from arealcli.schema.components.backends import (
    FSDPBackendArgs,
    HFBackendArgs,
    LocalBackendArgs,
    MegatronBackendArgs,
    SGLangBackendArgs,
    VLLMBackendArgs,
)
from arealcli.schema.components.datasets import (
    MARGIN,
    PAIR,
    ChatArgs,
    PreferenceArgs,
    PromptAnswerArgs,
    VerifiersTasksArgs,
)
from arealcli.schema.components.interfaces import (
    RETURNS_OUTPUTS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    DPOArgs,
    EnvRewardArgs,
    JudgeRewardArgs,
    ModelRewardArgs,
    PPOActorArgs,
    PPOCriticArgs,
    RemoteLogprobsArgs,
    RemoteRewardArgs,
    ReturnsArgs,
    RewardArgs,
    RewardModelArgs,
    SFTArgs,
    TopKDistillArgs,
)
from arealcli.schema.components.workflows import FunctionCallingArgs, OpenEnvArgs, ToolUseArgs, VerifiersArgs
from arealcli.schema.registry import (
    ADVANTAGES,
    BACKENDS,
    DATASETS,
    INTERFACES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    REWARDS,
    TOOLS,
    WORKFLOWS,
    Entry,
)

_R = "arealcli.runtime"


def _interface(
    name: str,
    target: str,
    args: type[BaseModel],
    description: str | None,
    call_types: Iterable[str],
    needs_model: bool = True,
    *,
    training_side: bool = False,
    value_head: bool = False,
    trained_head: bool = False,
    language_model: bool = False,
    learns_from_rewards: bool = False,
    trains_on_dataset: bool = False,
    trains_on_pairs: bool = False,
    train_inputs: Iterable[str] = (),
    generates: bool = False,
) -> None:
    INTERFACES.add(
        Entry(
            name,
            target,
            args,
            description or "",
            "builtin",
            frozenset(call_types),
            needs_model,
            training_side=training_side,
            value_head=value_head,
            trained_head=trained_head,
            language_model=language_model,
            learns_from_rewards=learns_from_rewards,
            trains_on_dataset=trains_on_dataset,
            trains_on_pairs=trains_on_pairs,
            train_inputs=frozenset(train_inputs),
            generates=generates,
        )
    )


_interface(
    "sft",
    f"{_R}.interfaces.sft:SFTInterface",
    SFTArgs,
    SFTArgs.__doc__,
    ["train_step"],
    language_model=True,
    trains_on_dataset=True,
)
_interface(
    "ppo_actor",
    f"{_R}.interfaces.ppo_actor:PPOActorInterface",
    PPOActorArgs,
    PPOActorArgs.__doc__,
    ["generate", "inference", "train_step"],
    language_model=True,
    learns_from_rewards=True,
    train_inputs=RETURNS_OUTPUTS,
)
_interface(
    "ppo_critic",
    f"{_R}.interfaces.ppo_critic:PPOCriticInterface",
    PPOCriticArgs,
    PPOCriticArgs.__doc__,
    ["inference", "train_step"],
    value_head=True,
    train_inputs=RETURNS_OUTPUTS,
)
_interface(
    "dpo",
    f"{_R}.interfaces.dpo:DPOInterface",
    DPOArgs,
    DPOArgs.__doc__,
    ["inference", "train_step"],
    language_model=True,
    trains_on_dataset=True,
    trains_on_pairs=True,
    train_inputs=[PAIR],  # and the reference's log-probs when the loss reads them: DPOArgs.train_inputs
)
_interface(
    "reward_model",
    f"{_R}.interfaces.reward_model:RewardModelInterface",
    RewardModelArgs,
    RewardModelArgs.__doc__,
    ["train_step"],
    value_head=True,
    trains_on_dataset=True,
    trains_on_pairs=True,
    train_inputs=[PAIR, MARGIN],
)
_interface(
    "rm_reward",
    f"{_R}.interfaces.reward_model:ModelRewardInterface",
    ModelRewardArgs,
    ModelRewardArgs.__doc__,
    ["inference"],
    value_head=True,
    trained_head=True,
)
_interface(
    "returns",
    f"{_R}.interfaces.returns:ReturnsInterface",
    ReturnsArgs,
    ReturnsArgs.__doc__,
    ["inference"],
    needs_model=False,
    training_side=True,
)
_interface(
    "reward",
    f"{_R}.interfaces.reward:RewardInterface",
    RewardArgs,
    RewardArgs.__doc__,
    ["inference"],
    needs_model=False,
)
_interface(
    "judge_reward",
    f"{_R}.interfaces.reward:JudgeRewardInterface",
    JudgeRewardArgs,
    JudgeRewardArgs.__doc__,
    ["inference"],
    needs_model=False,  # with `url:` none; without, the call's model judges (JudgeRewardArgs.needs_model)
    language_model=True,
    generates=True,
)
_interface(
    "distill_topk",
    f"{_R}.interfaces.distill_topk:TopKDistillInterface",
    TopKDistillArgs,
    TopKDistillArgs.__doc__,
    ["inference", "train_step"],
    language_model=True,
    train_inputs=[TOPK_IDS, TOPK_LOGPROBS],
)
_interface(
    "remote_logprobs",
    f"{_R}.interfaces.teacher:RemoteLogprobsInterface",
    RemoteLogprobsArgs,
    RemoteLogprobsArgs.__doc__,
    ["inference"],
    needs_model=False,
)
_interface(
    "env_reward",
    f"{_R}.interfaces.reward:EnvRewardInterface",
    EnvRewardArgs,
    EnvRewardArgs.__doc__,
    ["inference"],
    needs_model=False,
)
_interface(
    "remote_reward",
    f"{_R}.interfaces.reward:RemoteRewardInterface",
    RemoteRewardArgs,
    RemoteRewardArgs.__doc__,
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
    REWARDS.add(Entry(_name, f"{_R}.rewards.builtin:{_fn}", NoArgs, _doc, "builtin", binary=True))

# Algorithm variants (runtime/interfaces/variants.py): name, function, one line of what it is.
_V = f"{_R}.interfaces.variants"
for _name, _fn, _doc in [
    ("ppo", "ppo", "Clipped PPO (clip-higher, dual clip, decoupled, token or sequence ratio)."),
    ("gspo", "gspo", "GSPO: PPO's clipped objective on one ratio per sequence."),
    (
        "cispo",
        "cispo",
        "CISPO: clipped, detached importance weight times A log pi (every token keeps a gradient).",
    ),
]:
    POLICY_LOSSES.add(Entry(_name, f"{_V}:{_fn}", NoArgs, _doc, "builtin"))
for _name, _fn, _doc, _group in [
    ("batch", "batch", "GAE advantages whitened over the batch (PPO).", False),
    ("none", "none", "GAE advantages as they are.", False),
    ("group", "group", "Per prompt group, as group_std and leave_one_out say (default: GRPO).", True),
    ("grpo", "grpo", "GRPO: (s - group mean) / group std.", True),
    ("dr_grpo", "dr_grpo", "Dr.GRPO: s - group mean.", True),
    ("rloo", "rloo", "RLOO: s - mean of the group's other samples.", True),
    ("lite_ppo", "lite_ppo", "LitePPO: (s - group mean) / batch std.", True),
]:
    ADVANTAGES.add(Entry(_name, f"{_V}:{_fn}", NoArgs, _doc, "builtin", group_based=_group))
for _name, _fn, _doc in [
    ("k1", "k1", "log r (unbiased, can be negative)."),
    ("k2", "k2", "(log r)^2 / 2 (biased, >= 0, low variance)."),
    ("k3", "k3", "exp(-log r) - 1 + log r (unbiased, >= 0)."),
    ("abs", "abs_kl", "|log r| (biased, >= 0)."),
]:
    KL_ESTIMATORS.add(Entry(_name, f"{_V}:{_fn}", NoArgs, _doc, "builtin"))

# Preference losses of the dpo interface (runtime/interfaces/preference_losses.py).
_P = f"{_R}.interfaces.preference_losses"
for _name, _doc, _free in [
    (
        "sigmoid",
        "DPO: -log sigma(beta h), h the chosen-minus-rejected log-ratio (cDPO with label_smoothing).",
        False,
    ),
    ("ipo", "IPO: (h / tokens - 1 / (2 beta))^2 on per-token log-ratios.", False),
    ("hinge", "SLiC's hinge: max(0, 1 - beta h).", False),
    ("robust", "Robust DPO (rDPO): unbiased under labels flipped with probability label_smoothing.", False),
    ("simpo", "SimPO: no reference; length-normalized log-probs with a margin simpo_gamma.", True),
]:
    PREFERENCE_LOSSES.add(Entry(_name, f"{_P}:{_name}", NoArgs, _doc, "builtin", reference_free=_free))

TRAINING = frozenset({"train", "forward", "generate"})
GENERATION = frozenset({"generate", "update_weights"})
_BACKENDS: list[tuple[str, str, type[BaseModel], frozenset[str]]] = [
    ("hf", "backends.hf:HFBackend", HFBackendArgs, TRAINING | {"update_weights", "images"}),
    ("fsdp", "backends.fsdp:FSDPBackend", FSDPBackendArgs, TRAINING | {"images"}),
    (
        "megatron",
        "backends.megatron.backend:MegatronBackend",
        MegatronBackendArgs,
        TRAINING | {"update_weights"},
    ),
    ("local", "backends.local:LocalBackend", LocalBackendArgs, GENERATION | {"images"}),
    ("sglang", "backends.sglang:SGLangBackend", SGLangBackendArgs, GENERATION),
    ("vllm", "backends.vllm:VLLMBackend", VLLMBackendArgs, GENERATION),
]
for _name, _target, _args, _caps in _BACKENDS:
    BACKENDS.add(Entry(_name, f"{_R}.{_target}", _args, _args.__doc__ or "", "builtin", capabilities=_caps))

PROMPT_ANSWER_KEYS = frozenset(
    {"packed_input_ids", "prompt_mask", "loss_mask", "packed_prompts", "prompt", "answers"}
)
CHAT_KEYS = frozenset({"packed_input_ids", "prompt_mask", "loss_mask", "prompt"})
PREFERENCE_KEYS = frozenset({"packed_input_ids", "prompt_mask", "loss_mask", PAIR, "prompt", MARGIN})
_DATASETS: list[tuple[str, str, type[BaseModel], frozenset[str]]] = [
    ("prompt_answer", "datasets:PromptAnswerDataset", PromptAnswerArgs, PROMPT_ANSWER_KEYS),
    ("chat", "datasets:ChatDataset", ChatArgs, CHAT_KEYS),
    ("preference", "preferences:PreferenceDataset", PreferenceArgs, PREFERENCE_KEYS),
    ("verifiers", "tasksets:VerifiersTasksDataset", VerifiersTasksArgs, PROMPT_ANSWER_KEYS | {"task"}),
]
for _name, _target, _args, _keys in _DATASETS:
    DATASETS.add(Entry(_name, f"{_R}.data.{_target}", _args, _args.__doc__ or "", "builtin", data_keys=_keys))

for _name, _fn, _doc in [
    ("calculator", "calculator", "Arithmetic (+ - * / // % ** and parentheses) parsed with ast, never eval."),
    ("python", "python_tool", "Runs a Python program in a sandbox (no network, time and memory limits)."),
]:
    TOOLS.add(Entry(_name, f"{_R}.tools:{_fn}", NoArgs, _doc, "builtin"))
_WORKFLOWS: list[tuple[str, str, type[BaseModel]]] = [
    ("tool_use", "agents.workflows:ToolUseWorkflow", ToolUseArgs),
    ("function_calling", "agents.function_calling:FunctionCallingWorkflow", FunctionCallingArgs),
    ("openenv", "agents.openenv:OpenEnvWorkflow", OpenEnvArgs),
    ("verifiers", "agents.verifiers_env:VerifiersWorkflow", VerifiersArgs),
]
for _name, _target, _args in _WORKFLOWS:
    WORKFLOWS.add(Entry(_name, f"{_R}.{_target}", _args, _args.__doc__ or "", "builtin"))
