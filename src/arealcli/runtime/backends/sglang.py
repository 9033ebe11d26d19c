"""The `sglang` backend: generation on servers speaking SGLang's native HTTP protocol.

Connect to running servers (`addresses: [host:port, ...]`) or start them (`launch: sglang` for
`python -m sglang.launch_server`, `launch: embedded` for `areal serve`). Launched servers load the model's
initial weights, exported to `<run_dir>/weights/<model>/init`, and log to `<run_dir>/servers/`.
The engine (an InferenceEngine) generates (one request per prompt group, all groups in flight at once)
and follows another model's weights through `/update_weights_from_disk`; it does not train or run
forward passes (`areal check` refuses such calls on it).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from arealcli.runtime.backends.base import ModelBackend
from arealcli.runtime.clients import launcher
from arealcli.runtime.clients.client import GenerationClient
from arealcli.runtime.engines.inference import EventLoopThread, InferenceEngine, prompt_groups  # noqa: F401
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.models.weights import export_hf
from arealcli.runtime.wire.auth import API_KEY_ENV, WEIGHTS_DIR_ENV, fresh_key
from arealcli.runtime.wire.sglang import load_adapter_payload, update_weights_payload
from arealcli.schema.components.backends import SGLangBackendArgs


class SGLangEngine(InferenceEngine):
    """Generation on SGLang-protocol servers; a weight update is `/update_weights_from_disk` on each (with
    `abort_on_update`, requests in flight come back aborted and are continued on the new weights)."""

    def __init__(
        self,
        client: GenerationClient,
        loop: EventLoopThread,
        name: str,
        abort_on_update: bool = True,
        lora_name: str | None = None,
    ):
        super().__init__(client, loop, name)
        self.client, self.abort_on_update, self.lora_name = client, abort_on_update, lora_name

    async def _update_weights(self, path: str, version: int) -> None:
        path = str(Path(path).resolve())
        if self.lora_name is not None:  # an adapter update, served under its name beside the others
            await self.client.update_weights(load_adapter_payload(self.lora_name, path, version))
            return
        await self.client.update_weights(update_weights_payload(path, version, self.abort_on_update))


class SGLangBackend(ModelBackend):
    """Generation on SGLang servers over their native HTTP protocol: connect to `addresses` or `launch` them."""

    Args: type = SGLangBackendArgs  # VLLMBackend: VLLMBackendArgs
    capabilities = frozenset({"generate", "update_weights"})
    builds_weights = True  # connected servers hold their own; launched ones get an export of the source

    def __init__(self, args: SGLangBackendArgs):
        super().__init__(args)
        self.servers: list[launcher.ServerProcess] = []
        self.supervisor: launcher.Supervisor | None = None  # restarts launched servers that die or hang
        self.api_key: str | None = None  # the launched servers' key (fresh per run, never on a command line)
        self.loop: EventLoopThread | None = None
        self.client: GenerationClient | None = None
        self._tmp_dir: str | None = None

    @property
    def applies_adapter_updates(self) -> bool:
        """Do its servers take adapter-only updates of a LoRA model (our embedded server does)?"""
        a = self.args
        if getattr(a, "lora_name", None) is not None:
            return True
        return getattr(a, "launch", None) == "embedded" and getattr(a, "lora_updates", "merged") == "adapters"

    @property
    def merges_adapters(self) -> bool:
        """Do its servers merge adapter updates into the base exported beside them (or serve them apart)?"""
        return getattr(self.args, "lora_name", None) is None

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        a: SGLangBackendArgs = self.args
        try:
            if a.launch is not None:
                addresses = self._launch(model, spec)
            else:
                addresses = list(a.addresses)
            self.client = GenerationClient(
                addresses,
                **a.client_options(),
                max_abort_resends=a.max_abort_resends,
                supervisor=self.supervisor,
                api_key=self.api_key if a.launch is not None else a.key(),
                adapter=a.lora_name,
            )
            self.loop = EventLoopThread()
            self.loop.run(self.client.check_all())
        except BaseException:
            self.destroy(model)
            raise
        model.module = SGLangEngine(self.client, self.loop, model.name, a.abort_on_update, a.lora_name)
        return model

    def _launch(self, model: Model, spec: FinetuneSpec) -> list[str]:
        a: SGLangBackendArgs = self.args
        if spec.run_dir is not None:
            root = Path(spec.run_dir)
        else:
            self._tmp_dir = tempfile.mkdtemp(prefix="arealcli-servers-")
            root = Path(self._tmp_dir)
        weights = root / "weights" / model.name / "init"
        export_hf(model.initial_module(), model.tokenizer, weights)
        atexit.register(self._stop_servers)  # also when the trainer never reaches destroy()
        self.api_key = fresh_key()  # this run's, for its servers alone
        keys = {API_KEY_ENV: self.api_key, WEIGHTS_DIR_ENV: str((root / "weights").resolve())}
        self.servers = launcher.launch(a, str(weights), root / "servers", model.name, secrets=keys)
        launcher.wait_ready(self.servers, a.startup_timeout_s)
        self._supervise(model.name)
        return [s.address for s in self.servers]

    def _supervise(self, name: str) -> None:
        a = self.args
        if a.max_restarts > 0:
            self.supervisor = launcher.Supervisor(
                self.servers, name, a.startup_timeout_s, a.max_restarts, a.restart_window_s
            )

    def _stop_servers(self) -> None:
        launcher.stop(self.servers)
        self.servers = []
        if self.supervisor is not None:
            self.supervisor.close()
            self.supervisor = None

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
