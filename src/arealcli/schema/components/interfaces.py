"""Argument models of the built-in model interfaces."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PositiveInt, ValidationError, ValidationInfo, field_validator, model_validator

from arealcli.schema.base import Abstraction, StrictModel
from arealcli.schema.components.datasets import PAIR
from arealcli.schema.components.engine import GenerationHyperparameters
from arealcli.schema.registry import (
    ADVANTAGES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    REWARDS,
    WORKFLOWS,
)

# eval_reward_fn / `areal eval --reward`: the environment's reward of each held-out episode (an environment
# workflow's), not a registered reward function
ENVIRONMENT = "environment"


def _registered_reward(name: str | None) -> str | None:
    """A reward function name must be registered (checked by `areal check`, not at the first use)."""
    if name is not None:
        REWARDS.validated(name)
    return name


class SFTArgs(StrictModel):
    """Supervised fine-tuning: next-token NLL over answer tokens."""

    token_normalize_scope: Literal["global", "dp"] = Field(
        "global",
        description="Average the loss over all answer tokens of the batch (global) or per rank (dp).",
    )
    lr_scale: float = Field(
        1.0, gt=0, description="Multiplier on the backend's learning rate for this interface's updates."
    )


# What the `returns` call makes and the actor's and critic's updates read: rewards become advantages
# and returns once, with one KL controller (`kl_coef` is per-sample meta).
RETURNS_OUTPUTS = ("advantages", "returns", "seq_scores", "kl_coef")
# The reference model's per-token log-probs: an inference call of the reference, its `packed_logprobs`
# renamed (output_key_remap), read by the actor's KL term and by dpo's loss.
REF_LOGPROBS = "packed_ref_logprobs"
# top-k distillation: the teacher's k most likely next tokens at each position, and their log-probs
TOPK_IDS, TOPK_LOGPROBS = "packed_topk_ids", "packed_topk_logprobs"


class RewardShaping(StrictModel):
    """How scores become per-token rewards: the `returns` call's, computed once for the actor and the critic."""

    reward_bias: float = Field(0.0, description="Shaped score = clip((score - bias) * scale, -clip, +clip).")
    reward_scaling: float = Field(1.0, description="Scale of the shaped score.")
    max_reward_clip: float = Field(20.0, gt=0, description="Clip of the shaped score.")
    mask_no_eos_with_zero: bool = Field(False, description="A truncated response (no EOS) scores 0.")
    no_eos_score: float | None = Field(
        None,
        description="The score of a truncated response (no EOS) in place of its reward, before shaping "
        "(a learned reward model scores text it never saw, such as an answer cut off, at random).",
    )
    overlong_tokens: int | None = Field(None, gt=0, description="DAPO overlong penalty window (tokens).")
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="DAPO overlong penalty at the length limit."
    )
    kl_ctl: float = Field(0.0, ge=0, description="KL coefficient (initial value when adaptive).")
    kl_in_reward: bool = Field(
        False, description="Penalize KL in the reward (PPO) instead of in the loss (GRPO)."
    )
    discount: float = Field(1.0, ge=0, le=1, description="GAE gamma.")

    @model_validator(mode="after")
    def _one_no_eos_score(self) -> RewardShaping:
        if self.mask_no_eos_with_zero and self.no_eos_score not in (None, 0.0):
            raise ValueError(
                f"mask_no_eos_with_zero scores a truncated response 0 and no_eos_score {self.no_eos_score}: "
                "set one of them"
            )
        return self

    def no_eos_value(self) -> float | None:
        """The score a truncated response gets, or None to keep its reward."""
        return 0.0 if self.mask_no_eos_with_zero else self.no_eos_score


class WorkflowSpec(Abstraction):
    """A registered episode workflow (see `areal list workflows`) and its args."""


# the actor's keys that pick an algorithm variant by name, and the registries of their names
VARIANTS = {"policy_loss": POLICY_LOSSES, "adv_norm": ADVANTAGES, "kl_estimator": KL_ESTIMATORS}


class PPOActorArgs(StrictModel):
    """PPO/GRPO actor: generate, recompute log-probs (also the reference model), train with PPO."""

    generation: GenerationHyperparameters = Field(
        default_factory=GenerationHyperparameters,
        description="Sampling for rollouts (n = samples per prompt).",
    )
    shaping: RewardShaping = Field(
        default_factory=RewardShaping,
        description="Reward shaping and KL; the presets hand it to the returns call (the loss reads "
        "kl_in_reward: KL in the loss when false).",
    )
    mask_too_long: bool = Field(False, description="Drop truncated responses from the loss.")
    kl_estimator: str = Field(
        "k3",
        description="KL estimator of the KL loss, by name (areal list kl_estimators): k1 = log r, k2, "
        "k3 = low variance, abs, or one a plugin registers.",
    )
    adaptive_kl_target: float | None = Field(
        None, gt=0, description="Target KL of the adaptive controller (the presets' returns call has it)."
    )
    adaptive_kl_horizon: float = Field(
        10000, gt=0, description="Horizon of the adaptive KL controller (the returns call's)."
    )
    # --- advantages
    gae_lambda: float = Field(1.0, ge=0, le=1, description="GAE lambda (the presets' returns call uses it).")
    adv_norm: str = Field(
        "batch",
        description="Advantage estimator, by name (areal list advantages): batch (GAE whitened over all "
        "tokens), group (per prompt group of n samples, as group_std and leave_one_out say; preset grpo's "
        "default), none, grpo, dr_grpo, rloo, lite_ppo, or one a plugin registers.",
    )
    group_std: Literal["group", "batch", "none"] = Field(
        "group",
        description="With adv_norm=group: divide by the group std, the batch std (LitePPO), or not (Dr.GRPO).",
    )
    group_std_estimator: Literal["population", "unbiased"] = Field(
        "population",
        description="With group std: population std (realhf) or the n - 1 estimator (TRL, AReaL 1.0).",
    )
    leave_one_out: bool = Field(False, description="With adv_norm=group: RLOO baseline (mean of the others).")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop prompt groups whose samples all score the same (std 0)."
    )
    # --- loss
    policy_loss: str = Field(
        "ppo",
        description="Policy loss, by name (areal list policy_losses): ppo (clipped; the options below), "
        "gspo, cispo, or one a plugin registers.",
    )
    eps_clip: float = Field(
        0.2, gt=0, description="PPO ratio clip (lower side, and upper unless eps_clip_higher)."
    )
    eps_clip_higher: float | None = Field(None, gt=0, description="DAPO asymmetric upper clip.")
    c_clip: float | None = Field(None, gt=1, description="Dual clip constant for negative advantages.")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="Loss aggregation (seq-mean-token-sum-norm = Dr.GRPO)."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    temperature: float | None = Field(
        None, gt=0, description="Logits temperature for log-probs; default: generation.temperature."
    )
    n_minibatches: PositiveInt = Field(
        1, le=1 << 16, description="Optimizer steps per batch (each on a shuffled minibatch)."
    )
    lr_scale: float = Field(
        1.0, gt=0, description="Multiplier on the backend's learning rate for this interface's updates."
    )
    sample_reuse: PositiveInt = Field(1, le=1024, description="Passes over the batch (PPO epochs).")
    early_stop_imp_ratio: float | None = Field(
        None,
        gt=1,
        description="Zero the loss of a micro-batch whose mean ratio exceeds this (its gradient is 0; the "
        "optimizer step of the minibatch still runs on the other micro-batches).",
    )
    importance_ratio: Literal["token", "sequence"] = Field(
        "token",
        description="token: PPO's per-token ratio; sequence: GSPO's per-sequence ratio exp(mean log r) "
        "(use with aggregation seq-mean-token-mean and a small eps_clip, e.g. 3e-4).",
    )
    use_decoupled_loss: bool = Field(
        False,
        description="Decoupled PPO (asynchronous RL): the ratio against proximal log-probs recomputed by the "
        "current policy before the update (the presets add a prox_logprobs call), times the behaviour weight "
        "pi_prox / pi_behaviour.",
    )
    behav_imp_weight_cap: float | None = Field(
        None,
        gt=1,
        description="With use_decoupled_loss: tokens whose behaviour weight exceeds this are capped "
        "(behav_imp_weight_mode); they stay in the loss's denominator.",
    )
    behav_imp_weight_mode: Literal["mask", "truncate", "seq-mask", "seq-truncate"] = Field(
        "mask",
        description="mask: a capped token's loss is 0 (AReaL); truncate: its weight is the cap (TIS); "
        "seq-mask / seq-truncate: one weight per sequence, the geometric mean of its token weights, "
        "masked or truncated (sequence-level rollout correction).",
    )
    prox_logp_method: Literal["recompute", "loglinear", "rollout", "metrics"] = Field(
        "recompute",
        description="With use_decoupled_loss, the proximal log-probs: recompute (a forward pass, the "
        "prox_logprobs call); loglinear (no forward pass: log pi_b + alpha (log pi_theta - log pi_b), "
        "alpha = (V - v_b) / (V + 1 - v_b) from the sample's policy version v_b and the trainer's V); "
        "rollout (the behaviour log-probs); metrics (recompute, and log the loglinear error).",
    )
    workflow: WorkflowSpec | None = Field(
        None,
        description="Generate episodes instead of single responses (e.g. tool_use: the model calls tools, "
        "their output is appended, only the model's tokens train).",
    )
    # --- evaluation
    eval_reward_fn: str | None = Field(
        None,
        description="Reward that scores held-out prompts (greedy decoding); default: the training reward "
        "(a preset's reward_fn), else math. `environment`: the reward an environment workflow (openenv, "
        "verifiers) gives each held-out episode.",
    )
    eval_max_new_tokens: PositiveInt | None = Field(
        None, le=1 << 22, description="Default: generation.max_new_tokens."
    )

    @field_validator("eval_reward_fn")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        return name if name == ENVIRONMENT else _registered_reward(name)

    @field_validator("policy_loss", "adv_norm", "kl_estimator")
    @classmethod
    def _registered_variant(cls, name: str, info: ValidationInfo) -> str:
        """A registered name of the variant's registry (unknown: the names, with did-you-mean)."""
        return VARIANTS[str(info.field_name)].validated(name).name

    @field_validator("workflow")
    @classmethod
    def _workflow_args(cls, spec: WorkflowSpec | None) -> WorkflowSpec | None:
        """The workflow's args checked against its own model (typed, like every component's)."""
        if spec is None:
            return None
        entry = WORKFLOWS.validated(spec.type_)
        if isinstance(spec.args, entry.args_model):
            return spec
        try:
            typed = entry.args_model.model_validate(spec.args or {}, strict=True)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            raise ValueError(f"workflow args{'.' + where if where else ''}: {message}") from None
        return spec.model_copy(update={"args": typed})

    @model_validator(mode="after")
    def _consistent(self) -> PPOActorArgs:
        grouped = ADVANTAGES.validated(self.adv_norm).group_based
        if grouped and self.shaping.kl_in_reward:
            raise ValueError(
                f"adv_norm={self.adv_norm} normalizes sequence scores per prompt group, so the KL cannot be in "
                "the reward; set kl_in_reward: false (KL in the loss) or adv_norm: batch"
            )
        if grouped and self.generation.n < 2:
            raise ValueError(f"adv_norm={self.adv_norm} needs generation.n >= 2 samples per prompt (a group)")
        if self.leave_one_out and self.adv_norm != "group":
            raise ValueError("leave_one_out is a group baseline: set adv_norm: group (or adv_norm: rloo)")
        if self.group_std != "group" and self.adv_norm != "group":
            raise ValueError(
                f"group_std={self.group_std} chooses adv_norm=group's std; with adv_norm={self.adv_norm} it "
                "would be ignored (lite_ppo: group mean, batch std; dr_grpo: no std)"
            )
        if self.behav_imp_weight_cap is not None and not self.use_decoupled_loss:
            raise ValueError(
                "behav_imp_weight_cap caps pi_prox / pi_behaviour, which exists with use_decoupled_loss: true"
            )
        if self.prox_logp_method != "recompute" and not self.use_decoupled_loss:
            raise ValueError(
                f"prox_logp_method {self.prox_logp_method} chooses the decoupled loss's proximal log-probs: "
                "set use_decoupled_loss: true"
            )
        return self


class PPOCriticArgs(StrictModel):
    """PPO critic: value inference and the clipped value loss."""

    value_eps_clip: float = Field(0.2, gt=0, description="Clip of the value update around the old values.")
    gae_lambda: float = Field(
        0.95, ge=0, le=1, description="GAE lambda of the returns (the presets' returns call: returns_lambda)."
    )
    n_minibatches: PositiveInt = Field(1, le=1 << 16, description="Optimizer steps per batch.")
    lr_scale: float = Field(
        1.0, gt=0, description="Multiplier on the backend's learning rate for this interface's updates."
    )
    sample_reuse: PositiveInt = Field(1, le=1024, description="Passes over the batch.")


class TopKDistillArgs(PPOActorArgs):
    """Top-k on-policy distillation: the teacher's k most likely next tokens at each position of the
    student's samples (inference on the teacher), and the student trained on the KL from them (train_step);
    generation and the held-out evaluation are the actor's."""

    topk: PositiveInt = Field(
        16, le=1 << 20, description="Teacher tokens per position (the vocabulary's size: the exact KL)."
    )


class RewardModelArgs(StrictModel):
    """Bradley-Terry reward model: a value-head model trained on preference pairs to score responses."""

    center_rewards_coefficient: float = Field(
        0.0,
        ge=0,
        description="c of the loss's c * mean((s_w + s_l)^2), which keeps the scores near 0 (0: off).",
    )
    lr_scale: float = Field(
        1.0, gt=0, description="Multiplier on the backend's learning rate for this interface's updates."
    )


class ModelRewardArgs(StrictModel):
    """Score responses with a trained reward model (frozen): the score of prompt + response."""


class ReturnsArgs(StrictModel):
    """Shaped rewards, the KL penalty and GAE, computed once for the actor and the critic."""

    shaping: RewardShaping = Field(default_factory=RewardShaping, description="Reward shaping and KL.")
    gae_lambda: float = Field(1.0, ge=0, le=1, description="GAE lambda of the actor's advantages.")
    returns_lambda: float | None = Field(
        None, ge=0, le=1, description="GAE lambda of the critic's returns; default: gae_lambda."
    )
    adaptive_kl_target: float | None = Field(None, gt=0, description="Target KL of the adaptive controller.")
    adaptive_kl_horizon: float = Field(10000, gt=0, description="Horizon of the adaptive KL controller.")
    max_new_tokens: PositiveInt | None = Field(
        None, le=1 << 22, description="Generation length limit (for the DAPO overlong penalty)."
    )


class RewardArgs(StrictModel):
    """Score responses with a registered reward function (rule-based or your own)."""

    reward_fn: str = Field("math", description="Registered reward function (see `areal list rewards`).")

    _known = field_validator("reward_fn")(_registered_reward)


class EnvRewardArgs(StrictModel):
    """The rewards an environment gave its episodes (an environment workflow's `env_rewards`, e.g.
    openenv's summed step rewards), as they are."""


def _http_url(url: str, what: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a {what} URL is http://HOST[:PORT] or https://..., not {url!r}")
    return url


class ServiceArgs(StrictModel):
    """A service over HTTP: where it is, its key, and how it is asked (timeouts, retries, batches)."""

    _what: ClassVar[str] = "service"

    url: str = Field(description="The service's base URL (http:// or https://).")
    api_key_env: str | None = Field(
        None, description="Environment variable holding the service's key (sent as a bearer token)."
    )
    timeout_s: float = Field(60.0, gt=0, description="Seconds to wait for one batch's answer.")
    retries: int = Field(
        3, ge=0, le=20, description="Retries of a batch on 429, 5xx, a lost connection or a timeout."
    )
    batch_size: PositiveInt = Field(256, description="Samples per request (a step's samples are split).")
    concurrency: PositiveInt = Field(4, le=64, description="Requests in flight at once.")

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        return _http_url(url, cls._what)


class RemoteRewardArgs(ServiceArgs):
    """Score responses with a reward service over HTTP (protocol 1: POST URL/score, see `areal
    serve-reward`): a sandbox, a grader, any reward on another machine."""

    _what: ClassVar[str] = "reward service"

    url: str = Field(description="The service's base URL (http:// or https://); samples go to URL/score.")


class RemoteLogprobsArgs(ServiceArgs):
    """Log-probs of every token of the samples from an OpenAI-compatible server (POST URL/v1/completions
    with the token ids, `echo` and `logprobs`): a distillation teacher served elsewhere (`areal serve`,
    vLLM, SGLang)."""

    _what: ClassVar[str] = "teacher"

    url: str = Field(
        description="The server's base URL (http:// or https://); requests go to URL/v1/completions."
    )
    model_name: str | None = Field(
        None, description="The `model` field of the requests (a server serving several)."
    )
    batch_size: PositiveInt = Field(16, description="Sequences per request.")
    timeout_s: float = Field(120.0, gt=0, description="Seconds to wait for one batch's answer.")


JUDGE_FIELDS = ("prompt", "response", "answer")


class JudgeParse(StrictModel):
    """How a judge's reply becomes a score: a label from a set, a number in a range, or what a regex
    finds (its first group: a label when `labels` are given, else a number)."""

    labels: dict[str, float] | None = Field(
        None,
        description="Label -> score; the reply (after `regex`, else its start, spaces stripped) must be "
        "one of them, e.g. {Y: 1, N: 0}.",
    )
    number: list[float] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="[low, high]: the first number of the reply (or of the regex's first group), which "
        "must lie in that range, is the score.",
    )
    regex: str | None = Field(
        None,
        description="A Python regex searched in the reply; its first group (or the whole match) is the "
        "label or the number, e.g. 'Score: (\\d+)'.",
    )

    @field_validator("regex")
    @classmethod
    def _compiles(cls, regex: str | None) -> str | None:
        if regex is not None:
            import re

            try:
                re.compile(regex)
            except re.error as e:
                raise ValueError(f"not a regex: {e}") from None
        return regex

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, float] | None) -> dict[str, float] | None:
        if labels is not None and (not labels or any(not k.strip() for k in labels)):
            raise ValueError("labels are non-blank words mapped to scores, e.g. {Y: 1, N: 0}")
        return labels

    @model_validator(mode="after")
    def _one_rule(self) -> JudgeParse:
        if self.labels is not None and self.number is not None:
            raise ValueError("give `labels` or `number`, not both")
        if self.labels is None and self.number is None and self.regex is None:
            raise ValueError("give `labels` (e.g. {Y: 1, N: 0}), `number` ([0, 10]) or `regex`")
        if self.number is not None and not self.number[0] < self.number[1]:
            raise ValueError(f"number is [low, high] with low < high, not {list(self.number)}")
        return self


class JudgeSettings(StrictModel):
    """What a judge is asked and how its reply is read (shared by the interface and the preset form)."""

    template: str = Field(
        description="The judge's prompt: Python format fields {prompt}, {response} (needed) and {answer} "
        "(the first reference answer); {{ and }} are literal braces."
    )
    parse: JudgeParse = Field(description="How the reply becomes a score.")
    max_new_tokens: PositiveInt = Field(8, le=4096, description="Longest reply the judge may give.")
    unparsable_score: float | None = Field(
        None,
        description="The score of a reply the rule cannot read; null: such a reply stops the step with an "
        "error naming it. Either way each is counted (judge/unparsable) and said on the console.",
    )
    cache_size: int = Field(
        65536, ge=0, description="Replies kept for identical requests (0: ask every time)."
    )
    model_name: str | None = Field(
        None, description="URL judges: the `model` field of the request (a server serving several)."
    )
    api_key_env: str | None = Field(
        None, description="URL judges: the environment variable holding the server's key (bearer token)."
    )
    timeout_s: float = Field(120.0, gt=0, description="URL judges: seconds to wait for one batch's replies.")
    retries: int = Field(3, ge=0, le=20, description="URL judges: retries on 429, 5xx, a lost connection.")
    batch_size: PositiveInt = Field(64, description="Requests per batch sent to the judge.")
    concurrency: PositiveInt = Field(4, le=64, description="URL judges: batches in flight at once.")

    @field_validator("template")
    @classmethod
    def _fields(cls, template: str) -> str:
        import string

        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as e:
            raise ValueError(
                f"the template does not parse: {e} (write {{{{ and }}}} for literal braces)"
            ) from None
        for _, name, spec, conversion in parsed:
            if name is None:
                continue
            if name not in JUDGE_FIELDS or spec or conversion:
                raise ValueError(
                    f"template field {{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}} "
                    f"is not one of {{prompt}}, {{response}}, {{answer}} (literal braces: {{{{ and }}}})"
                )
        if not any(name == "response" for _, name, _, _ in parsed):
            raise ValueError("the template must show the judge the {response}")
        return template


class JudgeRewardArgs(JudgeSettings):
    """Score responses with a judge: a language model asked with a prompt template (the call's model, on
    any backend, or an OpenAI-compatible server at `url`), its reply read by a rule."""

    url: str | None = Field(
        None,
        description="Base URL of an OpenAI-compatible server (POST URL/v1/completions); null: the call's "
        "model judges.",
    )

    _http = field_validator("url")(lambda url: None if url is None else _http_url(url, "judge"))

    def needs_model(self) -> bool:
        """Without a URL the judge is the call's model."""
        return self.url is None


# the built-in losses that would ignore each of these arguments (a plugin's loss reads what it likes)
_IGNORED_BY = {"label_smoothing": ("ipo", "hinge"), "simpo_gamma": ("sigmoid", "ipo", "hinge", "robust")}


class DPOArgs(StrictModel):
    """Direct preference optimization on pairs (chosen, rejected) against a frozen reference model."""

    loss: str = Field(
        "sigmoid",
        description="Preference loss, by name (areal list preference_losses): sigmoid (DPO), ipo, hinge, "
        "robust (rDPO), simpo (no reference), or one a plugin registers.",
    )
    beta: float = Field(
        0.1,
        gt=0,
        description="beta: how far the policy may move from the reference (a larger beta keeps it closer); "
        "the implicit reward of a response is beta * (log pi - log pi_ref). IPO's tau; SimPO's beta.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="The probability that a pair's label is flipped: sigmoid becomes conservative DPO "
        "(cDPO), robust the unbiased rDPO; simpo smooths like sigmoid. 0: labels trusted.",
    )
    simpo_gamma: float = Field(
        0.5, ge=0, description="SimPO's target reward margin gamma (loss: simpo only)."
    )
    lr_scale: float = Field(
        1.0, gt=0, description="Multiplier on the backend's learning rate for this interface's updates."
    )

    @field_validator("loss")
    @classmethod
    def _registered_loss(cls, name: str) -> str:
        return PREFERENCE_LOSSES.validated(name).name

    @model_validator(mode="after")
    def _used(self) -> DPOArgs:
        """An argument the loss ignores, set away from its default, is a mistake worth saying."""
        for name, losses in _IGNORED_BY.items():
            if self.loss in losses and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(
                    f"loss {self.loss} does not use {name}; drop it (label_smoothing: sigmoid, robust, "
                    "simpo; simpo_gamma: simpo)"
                )
        return self

    def needs_reference(self) -> bool:
        """Does the loss read the reference model's log-probs (every built-in loss but simpo)?"""
        entry = PREFERENCE_LOSSES.find(self.loss)
        return entry is None or not entry.reference_free

    def train_inputs(self) -> frozenset[str]:
        """The keys the train_step call must be given: the pairs, and the reference's log-probs."""
        return frozenset({PAIR, REF_LOGPROBS} if self.needs_reference() else {PAIR})
