"""What `areal eval` evaluates besides a model of the training process: a model folder generating in
this process, or an OpenAI-compatible server (`areal serve`, vLLM, SGLang). Both have the
`generate(batch, gconfig) -> [Generated]` of runtime/eval's targets."""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Literal

from arealcli.errors import UserError
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.eval.run import EngineTarget, Generated
from arealcli.schema.components.engine import GenerationHyperparameters


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
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging

        from arealcli.runtime.backends.hf import HFBackend
        from arealcli.runtime.models.model import FinetuneSpec, Model, auto_class
        from arealcli.schema.components.backends import HFBackendArgs

        hf_logging.disable_progress_bar()
        try:
            config = AutoConfig.from_pretrained(model_dir)
            module = auto_class(config).from_pretrained(model_dir, dtype=getattr(torch, dtype))
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
