"""`remote_logprobs`: the log-probs of every token of the samples from an OpenAI-compatible server, for
on-policy distillation from a teacher served elsewhere (`dataflow: {preset: distill, teacher: {url:
...}}`). Its output stands where a local teacher's `ppo_actor` inference call puts its log-probs."""

from __future__ import annotations

import torch

from arealcli.runtime.clients.logprobs import RemoteLogprobs
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface, key_from_env
from arealcli.runtime.models.model import Model
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import RemoteLogprobsArgs


class RemoteLogprobsInterface(ModelInterface):
    """log p(x_{t+1} | x_<=t) of every token, asked of a server (`packed_logprobs`, remapped by the
    preset to `packed_ref_logprobs`)."""

    Args = RemoteLogprobsArgs
    needs_model = False

    def __init__(self, args: RemoteLogprobsArgs):
        super().__init__(args)
        key = key_from_env(args.api_key_env, "remote_logprobs")
        self.client = RemoteLogprobs(
            args.url, key, args.model_name, args.timeout_s, args.retries, args.batch_size, args.concurrency
        )

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        seqs = [s.tolist() for s in data.unpack("packed_input_ids")]
        logps = self.client(seqs)
        return SequenceSample(
            data.ids,
            {"packed_logprobs": [len(s) for s in seqs]},
            {"packed_logprobs": torch.tensor([x for lp in logps for x in lp], dtype=torch.float32)},
        )
