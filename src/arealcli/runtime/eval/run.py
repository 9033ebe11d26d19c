"""`areal eval`: a model (a folder, a run's checkpoint, or an OpenAI-compatible endpoint) on held-out
prompts: greedy decoding and n samples per prompt, scored by a reward function.

The local path is the one held-out evaluation takes during training: the prompts in the recipe's
`eval_dataset` batches, each batch one `generate` call of the `hf` engine, scored by the same reward;
so a run's final checkpoint evaluated greedily gives the run's final held-out score exactly. Endpoints get
the same prompts as token ids (`/v1/completions`, one request per prompt with `n`), so the tokenizer is
the recipe's on both sides.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from arealcli.errors import UserError
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.eval.metrics import PromptResult
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec


@dataclass
class Generated:
    ids: list[int]
    text: str
    truncated: bool  # cut at max_new_tokens


class EngineTarget:
    """A model of this process generating as the PPO actor does: `generate` calls of its engine, or
    episodes of a workflow (`episodes(batch, gconfig)`; the response is the final answer)."""

    def __init__(self, model: Any, episodes: Callable[[SequenceSample, Any], SequenceSample] | None = None):
        self.model, self.tokenizer, self.episodes = model, model.tokenizer, episodes

    def generate(self, batch: SequenceSample, g: GenerationHyperparameters) -> list[Generated]:
        if self.episodes is not None:
            from arealcli.runtime.interfaces.ppo_actor import decode_responses

            data = self.episodes(batch, g)
            _, texts = decode_responses(self.tokenizer, data)
            out = []
            for ids, pm, cut, text in zip(
                data.unpack("packed_input_ids"),
                data.unpack("prompt_mask"),
                data.unpack("seq_no_eos_mask"),
                texts,
                strict=True,
            ):
                out.append(Generated(ids[~pm.bool()].tolist(), text, bool(cut.item())))
            return out
        gen = self.model.module.generate(batch, MicroBatchSpec(), self.tokenizer, g)
        return [
            Generated(list(ids), self.tokenizer.decode(ids, skip_special_tokens=True), bool(cut))
            for ids, cut in zip(gen.output_ids, gen.no_eos, strict=True)
        ]

    def close(self) -> None:
        pass


class LocalTarget(EngineTarget):
    """A model folder generating in this process on the `hf` engine (fp32 by default, as training);
    `workflow` (a workflow spec): its episodes, as training generates them."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any,
        device: Literal["cpu", "cuda"] = "cpu",
        dtype: str = "float32",
        workflow: Any = None,
    ):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from arealcli.runtime.backends.hf import HFBackend
        from arealcli.runtime.models.model import FinetuneSpec, Model
        from arealcli.schema.components.backends import HFBackendArgs

        hf_logging.disable_progress_bar()
        try:
            module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot load the model in {model_dir}: {first}") from None
        model = HFBackend(HFBackendArgs(device=device)).initialize(
            Model("eval", module, tokenizer), FinetuneSpec(1, 1, 1, 1)
        )
        episodes = None
        if workflow is not None:
            from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
            from arealcli.schema.components.interfaces import PPOActorArgs

            actor = PPOActorInterface(PPOActorArgs.model_validate({"workflow": workflow}))
            episodes = functools.partial(actor._generate_episodes, model, workflow=actor.workflow)
        super().__init__(model, episodes)

    def close(self) -> None:
        self.model.backend.destroy(self.model)


class RemoteTarget:
    """An OpenAI-compatible server (`areal serve`, vLLM, SGLang): `/v1/completions` with token-id prompts."""

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        model: str | None = None,
        concurrency: int = 16,
        send_key: bool = False,
    ):
        from arealcli.runtime.serve.chat import RemoteChat

        self.chat = RemoteChat(url, model, send_key=send_key)  # checks the server answers, names its model
        self.tokenizer, self.concurrency = tokenizer, concurrency

    def _one(self, prompt: list[int], g: GenerationHyperparameters, n: int) -> list[Generated]:
        body: dict[str, Any] = {
            "model": self.chat.model,
            "prompt": prompt,
            "n": n,
            "max_tokens": g.max_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature,
            "top_p": 1.0 if g.greedy else g.top_p,
            "logprobs": 0,  # the tokens of each completion: its length without a tokenizer round trip
        }
        if g.stop_token_ids:
            body["stop_token_ids"] = g.stop_token_ids
        answer = self.chat.request("POST", "/completions", body)
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise UserError(f"{self.chat.base}/completions returned {len(choices)} choices for n={n}")
        out = []
        for c in choices:
            ids = c.get("token_ids") or (c.get("logprobs") or {}).get("tokens") or []
            out.append(Generated(list(ids), c.get("text") or "", c.get("finish_reason") == "length"))
        return out

    def generate(self, batch: SequenceSample, g: GenerationHyperparameters) -> list[Generated]:
        """Rows with the same prompt one after another (a repeated batch) go as one request with n."""
        from arealcli.runtime.engines.inference import prompt_groups

        prompts = [p.tolist() for p in batch.unpack("packed_prompts")]
        groups = prompt_groups(prompts)
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            parts = list(pool.map(lambda sg: self._one(prompts[sg[0]], g, sg[1]), groups))
        return [x for part in parts for x in part]

    def close(self) -> None:
        self.chat.close()


def answer_extractor(reward: str) -> Callable[[str], str | None]:
    """The answer a response gives, for majority votes: the math reward's extraction (normalized) for
    math-like rewards, else the stripped response."""
    if reward in ("math", "partial_credit"):
        from arealcli.runtime.rewards.math_verifier import extract_answer, normalize_answer

        def math_answer(text: str) -> str | None:
            found = extract_answer(text)
            return normalize_answer(found) if found is not None else None

        return math_answer
    return lambda text: text.strip() or None


@dataclass
class EvalPlan:
    reward: str
    greedy: GenerationHyperparameters | None  # None: no greedy pass
    sampled: GenerationHyperparameters | None  # None: no samples (n = 0)
    seed: int = 0


def evaluate(
    target: EngineTarget | RemoteTarget,
    batches: Iterable[SequenceSample],
    plan: EvalPlan,
    progress: Callable[[int], None] | None = None,
) -> list[PromptResult]:
    """Every prompt of `batches`: greedy (one batch, one call, as in training), then n samples."""
    import torch

    with torch.random.fork_rng(devices=[]):  # the caller's random stream (a training run's) is untouched
        torch.manual_seed(plan.seed)
        return _evaluate(target, batches, plan, progress)


def _evaluate(target, batches, plan: EvalPlan, progress) -> list[PromptResult]:
    from arealcli.runtime.registry import get_reward

    reward_fn, extract = get_reward(plan.reward), answer_extractor(plan.reward)
    results: list[PromptResult] = []
    for batch in batches:
        prompts, answers = batch.meta["prompt"], batch.meta["answers"]
        rows = [PromptResult(p, list(a)) for p, a in zip(prompts, answers, strict=True)]
        if plan.greedy is not None:
            out = target.generate(batch, plan.greedy)
            scores = reward_fn(prompts, [o.text for o in out], answers)
            for row, o, s in zip(rows, out, scores, strict=True):
                row.greedy, row.greedy_reward = o.text, float(s)
        if plan.sampled is not None:
            n = plan.sampled.n
            out = target.generate(batch.repeat_interleave(n), plan.sampled)
            texts = [o.text for o in out]
            scores = reward_fn(
                [p for p in prompts for _ in range(n)], texts, [a for a in answers for _ in range(n)]
            )
            for i, row in enumerate(rows):
                mine = out[i * n : (i + 1) * n]
                row.responses = [o.text for o in mine]
                row.rewards = [float(s) for s in scores[i * n : (i + 1) * n]]
                row.extracted = [extract(o.text) for o in mine]
                row.lengths = [len(o.ids) for o in mine]
                row.truncated = [o.truncated for o in mine]
        results.extend(rows)
        if progress is not None:
            progress(len(rows))
    return results
