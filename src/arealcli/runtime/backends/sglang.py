"""The `sglang` backend: generation on servers speaking SGLang's native HTTP protocol.

Connect to running servers (`addresses: [host:port, ...]`) or start them (`launch: sglang` for
`python -m sglang.launch_server`, `launch: embedded` for `areal serve`). Launched servers load the model's
initial weights, exported to `<run_dir>/weights/<model>/init`, and log to `<run_dir>/servers/`.
The engine generates (one request per prompt group, all groups in flight at once) and follows
another model's weights through `/update_weights_from_disk`; it does not train or run forward passes.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
from pathlib import Path

from arealcli.runtime.backends.base import ModelBackend
from arealcli.runtime.data import SequenceSample
from arealcli.runtime.generation import GenerationResult
from arealcli.runtime.model import FinetuneSpec, Model
from arealcli.runtime.server import launcher
from arealcli.runtime.server.client import EventLoopThread, GenerationClient, Sample
from arealcli.runtime.server.protocol import sampling_params, update_weights_payload
from arealcli.schema.components.backends import SGLangBackendArgs
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec


def prompt_groups(prompts: list[list[int]]) -> list[tuple[int, int]]:
    """(start, size) of runs of identical consecutive prompts: one request with n = size each."""
    groups: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == p:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((i, 1))
    return groups


def _version(sample: Sample) -> int | None:
    """The oldest numeric weight_version among the requests that produced the sample."""
    known = [int(v) for v in sample.weight_versions if v is not None and v.lstrip("-").isdigit()]
    return min(known) if known else None


class SGLangEngine:
    """Generates through a GenerationClient; everything else is a clear error."""

    def __init__(self, client: GenerationClient, loop: EventLoopThread, name: str):
        self.client, self.loop, self.name = client, loop, name

    def generate(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, tokenizer, gconfig: GenerationHyperparameters
    ) -> GenerationResult:
        """One result per sample of `packed_prompts`, in input order (mb_spec does not apply: the servers
        batch by themselves)."""
        prompts = [t.tolist() for t in input_.unpack("packed_prompts")]
        eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
        params = sampling_params(gconfig, eos, n=1)

        async def run() -> list[list[Sample]]:
            return await asyncio.gather(
                *(self.client.generate(prompts[start], params, n) for start, n in prompt_groups(prompts))
            )

        samples = [s for group in self.loop.run(run()) for s in group]
        return GenerationResult(
            [s.output_ids for s in samples],
            [s.logprobs for s in samples],
            [s.finish_type == "length" for s in samples],
            [_version(s) for s in samples],
        )

    def _unsupported(self, what: str):
        return NotImplementedError(
            f"model {self.name!r} runs on generation servers (backend sglang), which only generate; "
            f"{what} needs an in-process backend (hf, fsdp, megatron). To train on this model's samples, "
            "train another model and set `weights_from` on this one"
        )

    def train_batch(self, *args, **kwargs):
        raise self._unsupported("training")

    def eval_batch(self, *args, **kwargs):
        raise self._unsupported("evaluation of a loss")

    def forward(self, *args, **kwargs):
        raise self._unsupported("a forward pass (inference of log-probs or values)")

    def save_to_hf(self, tokenizer, save_dir: str) -> None:
        raise self._unsupported("exporting weights")


class SGLangBackend(ModelBackend):
    """Generation on SGLang servers over their native HTTP protocol: connect to `addresses` or `launch` them."""

    Args = SGLangBackendArgs

    def __init__(self, args: SGLangBackendArgs):
        super().__init__(args)
        self.servers: list[launcher.ServerProcess] = []
        self.loop: EventLoopThread | None = None
        self.client: GenerationClient | None = None
        self._tmp_dir: str | None = None

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        a: SGLangBackendArgs = self.args
        try:
            if a.launch is not None:
                addresses = self._launch(model, spec)
            else:
                addresses = list(a.addresses)
            by_address = {s.address: s for s in self.servers}
            self.client = GenerationClient(
                addresses,
                **a.client_options(),
                max_abort_resends=a.max_abort_resends,
                why_down=lambda address: by_address[address].why_down() if address in by_address else None,
            )
            self.loop = EventLoopThread()
            self.loop.run(self.client.check_all())
        except BaseException:
            self.destroy(model)
            raise
        model.module = SGLangEngine(self.client, self.loop, model.name)  # the torch module is released
        return model

    def _launch(self, model: Model, spec: FinetuneSpec) -> list[str]:
        a: SGLangBackendArgs = self.args
        if spec.run_dir is not None:
            root = Path(spec.run_dir)
        else:
            self._tmp_dir = tempfile.mkdtemp(prefix="arealcli-servers-")
            root = Path(self._tmp_dir)
        weights = root / "weights" / model.name / "init"
        export_hf(model.module, model.tokenizer, weights)
        atexit.register(self._stop_servers)  # also when the trainer never reaches destroy()
        self.servers = launcher.launch(a, str(weights), root / "servers", model.name)
        launcher.wait_ready(self.servers, a.startup_timeout_s)
        return [s.address for s in self.servers]

    def update_weights(self, model: Model, path: str, version: int) -> None:
        assert self.client is not None and self.loop is not None
        payload = update_weights_payload(str(Path(path).resolve()), version, self.args.abort_on_update)
        self.loop.run(self.client.update_weights(payload))

    def _stop_servers(self) -> None:
        launcher.stop(self.servers)
        self.servers = []

    def destroy(self, model: Model) -> None:
        if self.client is not None and self.loop is not None:
            try:
                self.loop.run(self.client.aclose(), timeout=5)
            except Exception:  # closing idle connections must not hide the real error
                pass
        if self.loop is not None:
            self.loop.close()
        self.client = self.loop = None
        self._stop_servers()
        atexit.unregister(self._stop_servers)
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None


def export_hf(module, tokenizer, directory: Path) -> None:
    """Write an HF directory atomically (temporary directory + rename)."""
    if directory.exists():
        shutil.rmtree(directory)
    tmp = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    module.save_pretrained(str(tmp), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, directory)
