"""The PPO/GRPO actor: generate rollouts, recompute log-probs (also for the reference), train.

`inference` is `compute_logp`; one `train_step` is, top to bottom:
  compute_advantages  the registered advantage estimator (`adv_norm`) over the returns call's scores
                      and GAE advantages (the returns call shaped the scores and put the KL in them)
  loss_batch          what the loss reads, per token; DAPO's dynamic sampling
  ppo_update          minibatches x sample_reuse optimizer steps of the registered policy loss
                      (`policy_loss`), + the KL loss (`kl_estimator`) and the entropy bonus
Variants are plain functions in registries (interfaces/variants.py; a plugin adds its own).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from arealcli.runtime import distributed
from arealcli.runtime.algo import functional as F
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput, takes_lm_output
from arealcli.runtime.interfaces import token_logprobs
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.interfaces.rl_common import (
    given_returns,
    group_ids,
    response_view,
    shuffled_minibatches,
    to_packed,
)
from arealcli.runtime.interfaces.sft import answer_token_mask
from arealcli.runtime.models.model import Model
from arealcli.runtime.registry import make_workflow, reward_is_binary
from arealcli.runtime.vision import per_sample_images, stacked
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
from arealcli.schema.components.interfaces import PPOActorArgs
from arealcli.schema.registry import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES


@takes_lm_output
def next_token_logprobs(
    outputs: LMOutput | torch.Tensor, mb: SequenceSample, temperature: float
) -> torch.Tensor:
    """(tokens,) log p(x_{t+1} | x_<=t) at every position; 0 at the last position of each sequence.
    From a micro-batch's `LMOutput` chunk by chunk, or from packed logits (tokens, V)."""
    return token_logprobs.next_token_logprobs(outputs, mb, temperature)


def version_lag_stats(trainer_version: int, versions: list[int], buckets: int = 8) -> dict[str, float]:
    """How many policy versions old the samples are: mean, max, and the fraction at each lag
    (`version_lag_hist/k`; the last bucket counts k or more)."""
    lags = [trainer_version - v for v in versions]
    out = {"version_lag": sum(lags) / max(len(lags), 1), "version_lag_max": float(max(lags, default=0))}
    for k in range(min(buckets, max(lags, default=0) + 1)):
        n = sum(1 for lag in lags if (lag == k if k < buckets - 1 else lag >= k))
        out[f"version_lag_hist/{k}"] = n / max(len(lags), 1)
    return out


class PPOActorInterface(ModelInterface):
    """PPO/GRPO actor: generate, recompute log-probs (also the reference model), train with PPO."""

    Args = PPOActorArgs

    def __init__(self, args: PPOActorArgs):
        super().__init__(args)
        # No per-step state: one object serves every call of its model, generate on the rollout thread
        # and train_step on the trainer's at once. The KL coefficient comes with the batch.
        self.temperature = args.temperature or (
            1.0 if args.generation.greedy else args.generation.temperature
        )
        self.workflow = make_workflow(args.workflow) if args.workflow is not None else None
        # the algorithm variants the args name (registered functions: interfaces/variants.py, plugins)
        self.estimate_advantages = ADVANTAGES.get(args.adv_norm).load()
        self.policy_loss = POLICY_LOSSES.get(args.policy_loss).load()
        self.kl_estimate = KL_ESTIMATORS.get(args.kl_estimator).load()

    # ------------------------------------------------------------------ generate

    def generate(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        g = self.args.generation
        rep = data.repeat_interleave(g.n)  # ids (prompt id, j), j < n
        if self.workflow is not None:
            return self._generate_episodes(model, rep, g, self.workflow)
        out = model.module.generate(rep, mb_spec, model.tokenizer, g)
        versions = out.versions or [None] * rep.bs  # inference engines report theirs per sample
        last_versions = out.last_versions or versions
        seqs, prompt_masks, logprobs, no_eos = [], [], [], []
        for prompt, gen, lp, trunc in zip(
            rep.unpack("packed_prompts"), out.output_ids, out.logprobs, out.no_eos, strict=True
        ):
            p, n = prompt.shape[0], len(gen)
            seqs.append(torch.cat([prompt.cpu(), torch.tensor(gen, dtype=torch.long)]))
            prompt_masks.append(torch.tensor([True] * p + [False] * n))
            aligned = torch.zeros(p + n)
            aligned[p - 1 : p + n - 1] = torch.tensor(lp)  # position t holds log p(token t+1)
            logprobs.append(aligned)
            no_eos.append(torch.tensor([float(trunc)]))
        out_sample = SequenceSample.from_lists(
            rep.ids,
            {
                "packed_input_ids": seqs,
                "prompt_mask": prompt_masks,
                "packed_logprobs": logprobs,
                "seq_no_eos_mask": no_eos,
            },
            {
                # the policy versions that generated each sample: first and last (a weight update may
                # interrupt a sample, which then continues on the new weights)
                "version": [model.version.global_step if v is None else v for v in versions],
                "version_last": [model.version.global_step if v is None else v for v in last_versions],
            },
        )
        out_sample.stats = {"generated_tokens": float(sum(len(g) for g in out.output_ids))}
        return out_sample

    def _generate_episodes(self, model: Model, rep: SequenceSample, g, workflow: Any) -> SequenceSample:
        """Episodes of `workflow` (this interface's): every token kept, `loss_mask` True on the model's own
        tokens."""
        prompts = [p.tolist() for p in rep.unpack("packed_prompts")]
        images = per_sample_images(rep)  # a vision-language model's: each turn generates with them
        extra: dict[str, Any] = {"images": images} if images is not None else {}
        if getattr(workflow, "takes_tasks", False):  # an environment's tasks (the `verifiers` dataset's)
            extra["tasks"] = rep.meta.get("task")
        episodes = workflow.run(model.module, model.tokenizer, prompts, g, **extra)
        seqs, prompt_masks, loss_masks, logprobs, no_eos, versions, lasts = [], [], [], [], [], [], []
        for prompt, ep in zip(prompts, episodes, strict=True):
            prompt = prompt if ep.prompt is None else ep.prompt
            p, n = len(prompt), len(ep.tokens)
            seqs.append(torch.tensor(prompt + ep.tokens, dtype=torch.long))
            prompt_masks.append(torch.tensor([True] * p + [False] * n))
            loss_masks.append(torch.tensor([False] * p + list(ep.mask)))
            aligned = torch.zeros(p + n)
            aligned[p - 1 : p + n - 1] = torch.tensor(ep.logprobs)  # position t holds log p(token t+1)
            logprobs.append(aligned)
            no_eos.append(torch.tensor([float(ep.no_eos)]))
            here = model.version.global_step
            versions.append(min(ep.versions, default=here))
            lasts.append(max(ep.versions, default=here))
        keys = {
            "packed_input_ids": seqs,
            "prompt_mask": prompt_masks,
            "loss_mask": loss_masks,
            "packed_logprobs": logprobs,
            "seq_no_eos_mask": no_eos,
        }
        if images is not None:  # the prompt's pictures, then those the tools returned, in order
            seen = [stacked([im, *ep.images]) for im, ep in zip(images, episodes, strict=True)]
            keys["pixel_values"], keys["image_grid_thw"] = [x[0] for x in seen], [x[1] for x in seen]
        scored = [ep.reward for ep in episodes if ep.reward is not None]
        if scored:  # an environment scored its episodes: `env_reward` hands these on as the rewards
            if len(scored) != len(episodes):
                raise RuntimeError("an environment workflow scored some of its episodes and not others")
            keys["env_rewards"] = [torch.tensor([float(ep.reward or 0.0)]) for ep in episodes]
        out = SequenceSample.from_lists(rep.ids, keys, {"version": versions, "version_last": lasts})
        n = max(len(episodes), 1)
        out.stats = {
            "generated_tokens": float(sum(sum(ep.mask) for ep in episodes)),
            "episode/turns": sum(ep.turns for ep in episodes) / n,
            "episode/tokens": sum(len(ep.tokens) for ep in episodes) / n,
        }
        if scored:  # an environment's episodes: its reward and numbers (below), no tools of ours
            out.stats["env/reward"] = sum(scored) / n
        else:
            out.stats["episode/tool_calls"] = sum(ep.tool_calls for ep in episodes) / n
            out.stats["episode/tool_call_rate"] = sum(ep.tool_calls > 0 for ep in episodes) / n
            out.stats["episode/tool_errors"] = sum(ep.tool_errors for ep in episodes) / n
        for name in sorted({k for ep in episodes for k in ep.metrics}):  # the environment's own numbers
            values = [ep.metrics[name] for ep in episodes if name in ep.metrics]
            out.stats[f"env/{name}"] = sum(values) / len(values)
        return out

    # ------------------------------------------------------------------ inference: compute_logp

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        return self.compute_logp(model, data, mb_spec)

    def compute_logp(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        """log p(x_{t+1} | x_<=t) of every token under this model (the old policy before an update, the
        reference model, the proximal policy of decoupled PPO): `packed_logprobs`."""
        t = self.temperature
        logp = model.module.forward(
            data, mb_spec, post_hook=takes_lm_output(lambda out, mb: next_token_logprobs(out, mb, t))
        )
        return SequenceSample(
            data.ids,
            {"packed_logprobs": list(data.seqlens["packed_input_ids"])},
            {"packed_logprobs": logp.cpu()},
        )

    # ------------------------------------------------------------------ train: compute_advantages -> ppo_update

    def train_step(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> dict[str, float]:
        """One PPO step: advantages from the returns call's output, the batch the loss trains on, then
        minibatches x sample_reuse optimizer steps of the policy loss."""
        r = given_returns(data, "ppo_actor's train_step")  # and its KL coefficient: one controller
        adv, mask, stats = self.compute_advantages(data, r)
        if "version" in data.meta:  # policy versions between the samples' generator and this model
            stats.update(version_lag_stats(model.version.global_step, data.meta["version"]))
        train, kept_stats = self.loss_batch(model, data, adv, mask)
        stats.update(kept_stats)
        stats.update(self.ppo_update(model, train, mb_spec, r.kl_coef))
        model.inc_version()
        return stats

    def compute_advantages(self, data: SequenceSample, r: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(advantages (B, T), loss mask (B, T), reward statistics): the registered estimator `adv_norm`
        over the sequence scores and the returns call's GAE advantages."""
        a = self.args
        no_eos = data.data["seq_no_eos_mask"].bool()  # (B,)
        mask = r.mask & ~no_eos[:, None] if a.mask_too_long else r.mask  # (B, T)
        adv = self.estimate_advantages(r.scores, r.advantages, mask, group_ids(data), a)  # (B, T)
        stats = {
            "score_shaped": float(r.scores.mean()),
            "response_len": float(r.mask.sum(-1).float().mean()),
            "no_eos_frac": float(no_eos.float().mean()),
            "adv_abs": float(F.masked_mean(adv.abs(), mask)),
            "kl_coef": r.kl_coef,
        }
        if "rewards" in data.data:  # distillation without a task reward has none
            raw = data.data["rewards"].float()  # (B,)
            stats["reward"] = float(raw.mean())
            stats["reward_std"] = float(raw.std(unbiased=False))
            stats["accuracy"] = float((raw > 0.5).float().mean())
        if r.kl is not None:  # to the reference, or distillation's teacher: per token, and each side
            stats["kl_ref"] = float(F.masked_mean(r.kl, r.mask))
            old_logp, _ = response_view(data.data["packed_logprobs"].float(), data)
            ref_logp, _ = response_view(data.data["packed_ref_logprobs"].float(), data)
            stats["logp_policy"] = float(F.masked_mean(old_logp, r.mask))
            stats["logp_ref"] = float(F.masked_mean(ref_logp, r.mask))
        return adv, mask, stats

    def loss_batch(
        self, model: Model, data: SequenceSample, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[SequenceSample, dict[str, float]]:
        """What the policy loss reads, packed per token (advantages, old / reference / proximal log-probs,
        the action mask), of the samples it trains on (DAPO's dynamic sampling drops uniform groups)."""
        keep = torch.ones(data.bs, dtype=torch.bool)
        stats: dict[str, float] = {}
        if self.args.dynamic_sampling:
            keep = F.dynamic_sampling_mask(data.data["rewards"].float(), group_ids(data))
            stats["dynamic_sampling_kept"] = float(keep.float().mean())
        # episodes: the loss counts the model's own tokens only (never prompts or tool output)
        train = data.select(
            ["packed_input_ids", "prompt_mask", *(["loss_mask"] if "loss_mask" in data.data else [])]
        )
        train.data["advantages"] = to_packed(adv, data)
        train.data["old_logp"] = data.data["packed_logprobs"].float()
        train.data["action_mask"] = to_packed(mask.float(), data)
        if "packed_ref_logprobs" in data.data:
            train.data["ref_logp"] = data.data["packed_ref_logprobs"].float()
        if self.args.use_decoupled_loss:
            train.data.update(self._proximal(model, data, mask))
        for k in ("advantages", "old_logp", "action_mask", "ref_logp", "prox_logp", "prox_alpha"):
            if k in train.data:
                train.seqlens[k] = list(train.seqlens["packed_input_ids"])
        return train.subset([i for i in range(data.bs) if keep[i]]), stats

    def ppo_update(
        self, model: Model, train: SequenceSample, mb_spec: MicroBatchSpec, kl_coef: float
    ) -> dict[str, float]:
        """sample_reuse passes over `train`, each in n_minibatches shuffled minibatches, one optimizer
        step each; the statistics are their means."""
        a = self.args
        seeds = [model.version.global_step * 1000 + epoch for epoch in range(a.sample_reuse)]
        loss_fn = functools.partial(self._loss_fn, kl_coef=kl_coef)  # still marked (outputs_for)
        return self.minibatch_updates(model, train, mb_spec, loss_fn, self._loss_weight, seeds)

    def minibatch_updates(
        self,
        model: Model,
        train: SequenceSample,
        mb_spec: MicroBatchSpec,
        loss_fn,
        loss_weight,
        seeds: list[int],
    ) -> dict[str, float]:
        """A pass over `train` per seed, each in n_minibatches minibatches shuffled by that seed, one
        optimizer step each (every rank the same number); the statistics are their means, `n_updates`."""
        train_stats: dict[str, float] = {}
        n_updates = 0
        if train.bs or distributed.world() > 1:  # every rank steps the same number of times
            for seed in seeds:
                for idx in shuffled_minibatches(train.bs, self.args.n_minibatches, seed):
                    s = model.module.train_batch(
                        train.subset(idx),
                        mb_spec,
                        loss_fn,
                        loss_weight,
                        version_steps=model.version.global_step,
                        lr_scale=self.args.lr_scale,
                    )
                    for k, v in s.items():
                        train_stats[k] = train_stats.get(k, 0.0) + v
                    n_updates += 1
        stats = {k: v / max(n_updates, 1) for k, v in train_stats.items()}
        stats["n_updates"] = float(n_updates)
        return stats

    def _proximal(self, model: Model, data: SequenceSample, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the decoupled loss needs of the proximal policy (the weights before this update), per
        `prox_logp_method`: its recomputed log-probs (`prox_logp`: recompute, metrics), the behaviour
        log-probs (rollout), or the log-linear weight of each token (`prox_alpha`: loglinear, metrics)."""
        method = self.args.prox_logp_method
        out: dict[str, torch.Tensor] = {}
        if method in ("recompute", "metrics"):
            if "packed_prox_logprobs" not in data.data:
                raise RuntimeError(
                    f"prox_logp_method {method} needs proximal log-probs (packed_prox_logprobs): an inference "
                    "call on the trained model before this one (the grpo/ppo presets add `prox_logprobs`)"
                )
            out["prox_logp"] = data.data["packed_prox_logprobs"].float()
        elif method == "rollout":
            out["prox_logp"] = data.data["packed_logprobs"].float()
        if method in ("loglinear", "metrics"):
            now = model.version.global_step
            versions = data.meta.get("version") or [now] * data.bs
            alpha = F.loglinear_alpha(torch.tensor(versions, dtype=torch.float32), now)  # (B,)
            out["prox_alpha"] = to_packed(alpha[:, None] * mask, data)
        return out

    def _action_mask(self, mb: SequenceSample) -> torch.Tensor:
        return answer_token_mask(mb) & mb.data["action_mask"].bool()

    def _loss_weight(self, mb: SequenceSample) -> float:
        m, _ = response_view(self._action_mask(mb).float(), mb)
        if self.args.aggregation == "token-mean":
            return float(m.sum())
        return (
            float((m.sum(-1) > 0).sum()) if self.args.aggregation == "seq-mean-token-mean" else float(mb.bs)
        )

    @takes_lm_output  # `logits` is the micro-batch's LMOutput: log-probs and entropy chunk by chunk
    def _loss_fn(self, logits: LMOutput | torch.Tensor, mb: SequenceSample, kl_coef: float):
        a = self.args
        logp_tok, ent_tok = token_logprobs.next_token_logprobs_and_entropy(logits, mb, self.temperature)
        logp, _ = response_view(logp_tok, mb)  # (B, T)
        old, _ = response_view(mb.data["old_logp"].to(logits.device), mb)
        adv, _ = response_view(mb.data["advantages"].to(logits.device), mb)
        mask, _ = response_view(mb.data["action_mask"].to(logits.device), mb)
        prox = (
            response_view(mb.data["prox_logp"].to(logits.device), mb)[0] if "prox_logp" in mb.data else None
        )
        recomputed = prox if a.prox_logp_method in ("recompute", "metrics") else None
        prox_stats: dict[str, torch.Tensor] = {}
        if "prox_alpha" in mb.data:  # log-linear proximal log-probs, from the behaviour and current ones
            alpha, _ = response_view(mb.data["prox_alpha"].to(logits.device), mb)
            approx = F.loglinear_prox_logp(old, logp.detach(), alpha)
            if prox is None:
                prox = approx
            else:  # metrics: how far the approximation is from the recomputed log-probs
                prox_stats = F.prox_approx_errors(approx, prox, old, mask)
        # the generator's log-probs vs the trainer's: the recomputed proximal ones, or else the current
        # ones (the weights before this update on the step's first minibatch)
        prox_stats.update(F.mismatch_stats(old, logp.detach() if recomputed is None else recomputed, mask))
        loss, stats = self.policy_loss(logp, old, adv, mask, a, prox_logp=prox)
        stats.update(prox_stats)
        if "ref_logp" in mb.data and kl_coef > 0 and not a.shaping.kl_in_reward:
            ref, _ = response_view(mb.data["ref_logp"].to(logits.device), mb)
            # aggregated like the policy loss (TRL, verl): with Dr.GRPO's sum / max_len the KL too
            kl_tokens = self.kl_estimate(logp, ref)  # (B, T)
            kl = F.aggregate_loss(kl_tokens, mask, a.aggregation, a.generation.max_new_tokens)
            loss = loss + kl_coef * kl
            stats["kl_loss"] = kl.detach()
        act = self._action_mask(mb).to(logits.device)  # responses removed from the loss get no bonus
        with torch.set_grad_enabled(a.entropy_coef > 0):  # only a statistic unless it is in the loss
            ent = ent_tok[act]  # (action tokens,) entropy of softmax(logits / T)
            ent = ent.mean() if ent.numel() else ent_tok.new_zeros(())
        stats["entropy"] = ent.detach()
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * ent
        if a.early_stop_imp_ratio is not None and float(stats["ratio_mean"]) > a.early_stop_imp_ratio:
            loss = loss * 0.0
            stats["early_stopped"] = torch.tensor(1.0)
        return loss, stats

    # ------------------------------------------------------------------ evaluate / state

    @torch.no_grad()
    def evaluate(self, model: Model, loader, samples: Any = None) -> dict[str, float]:
        """Greedy decoding on held-out prompts, scored by `eval_reward_fn`; with `samples` (the recipe's
        `trainer.eval: {n, k, temperature}`) also n samples per prompt: avg@k, and for a 0/1 reward pass@k
        and maj@k. The code of `areal eval` (runtime/eval), on this rank's prompts; means over ranks."""
        from arealcli.runtime.eval.metrics import per_prompt_values
        from arealcli.runtime.eval.run import EngineTarget, EvalPlan, evaluate

        a = self.args
        name = a.eval_reward_fn or "math"
        max_new = a.eval_max_new_tokens or a.generation.max_new_tokens
        stop = a.generation.stop_token_ids
        greedy = GenerationHyperparameters(greedy=True, max_new_tokens=max_new, stop_token_ids=stop)
        sampled = None
        if samples is not None:
            sampled = GenerationHyperparameters(
                n=samples.n, temperature=samples.temperature, max_new_tokens=max_new, stop_token_ids=stop
            )
        episodes = None
        if self.workflow is not None:  # greedy episodes, scored on their final answers
            episodes = functools.partial(self._generate_episodes, model, workflow=self.workflow)
        plan = EvalPlan(name, greedy, sampled, seed=samples.seed if samples is not None else 0)
        results = evaluate(EngineTarget(model, episodes), loader, plan)
        binary = reward_is_binary(name)
        values = per_prompt_values(results, samples.ks() if samples is not None else [], binary)
        values.pop("greedy_accuracy", None) if binary else values.pop("greedy_reward", None)
        keys = sorted(values)
        greedy_scores = [r.greedy_reward or 0.0 for r in results]
        sums = distributed.all_reduce(
            [float(sum(greedy_scores)), float(len(results))] + [float(sum(values[k])) for k in keys]
        )
        n = max(sums[1], 1.0)
        # a 0/1 reward's mean is the accuracy; any other reward is reported as itself, by name
        out = {"accuracy" if binary else f"reward/{name}": sums[0] / n}
        out.update({k: v / n for k, v in zip(keys, sums[2:], strict=True)})
        return out
