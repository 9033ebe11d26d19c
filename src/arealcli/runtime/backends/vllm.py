"""The `vllm` backend: generation on vLLM servers through their OpenAI-compatible API.

Connect to running servers (`addresses: [host:port, ...]`) or start them (`launch: true`:
`python -m vllm.entrypoints.openai.api_server` from `python_executable`, with `VLLM_SERVER_DEV_MODE=1` and
`--logprobs-mode processed_logprobs`). Launched servers load the model's initial weights, exported to
`<run_dir>/weights/<model>/init`, log to `<run_dir>/servers/<model>-<i>.log` and stop on destroy (or when
the trainer process dies). They are keyed on every path but /health by a middleware of ours
(runtime/wire/guard; vLLM itself checks its key under /v1 only), which also proves to the launcher
that the server holds the run's key before the key is sent to it. Like `sglang`, the engine only
generates; it follows another model's weights (`weights_from`) by an in-place reload from the exported
directory (see runtime/clients/vllm.py for the endpoints and what happens to requests in flight).
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from pathlib import Path

from arealcli.runtime.backends.sglang import SGLangBackend
from arealcli.runtime.clients import launcher
from arealcli.runtime.clients.vllm import VLLMClient
from arealcli.runtime.engines.inference import EventLoopThread, InferenceEngine
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.models.weights import export_hf
from arealcli.runtime.wire.auth import VLLM_API_KEY_ENV, fresh_key
from arealcli.runtime.wire.guard import GUARD_DIR, MIDDLEWARE
from arealcli.schema.checks.placement import compact
from arealcli.schema.components.backends import VLLMBackendArgs, share

PYTHON_ENV = "AREALCLI_VLLM_PYTHON"


class VLLMEngine(InferenceEngine):
    """Generation on vLLM servers; a weight update waits for the requests in flight, then reloads in place
    (same path on every machine)."""

    def __init__(self, client: VLLMClient, loop: EventLoopThread, name: str):
        super().__init__(client, loop, name)
        self.client = client

    async def _update_weights(self, path: str, version: int) -> None:
        weights = Path(path).resolve()
        if self.client.adapter is not None:  # a LoRA adapter (peft's format), reloaded in place by name
            await self.client.reload_weights(str(weights), version)
            return
        # vLLM's engine dies on a reload from a missing or empty directory: refuse before asking it
        if not weights.is_dir() or not any(weights.glob("*.safetensors")):
            raise FileNotFoundError(
                f"no safetensors weights in {weights}: vLLM reloads HF safetensors exports "
                "(save_pretrained(..., safe_serialization=True))"
            )
        config = (
            json.loads((weights / "config.json").read_text()) if (weights / "config.json").exists() else {}
        )
        tied = bool(config.get("tie_word_embeddings", False))
        await self.client.reload_weights(str(weights), version, tied_embeddings=tied)


# vLLM's --max-lora-rank takes one of these (vllm/config/lora.py)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def server_command(
    args: VLLMBackendArgs, python: str, model_path: str, port: int, lora_rank: int | None = None
) -> list[str]:
    """The vLLM server's command line; with `lora_rank` (following a LoRA model by its adapters), LoRA
    support for one adapter of up to that rank."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    cmd += ["--host", args.host, "--port", str(port), "--dtype", args.dtype]
    cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    # log-probs of the sampling distribution (temperature, top-k, top-p applied), like the other backends;
    # sampling defaults from vLLM, not from the model's generation_config.json
    cmd += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    if args.max_model_len is not None:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.kv_cache_memory_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if lora_rank is not None:
        fit = next((r for r in LORA_RANKS if r >= lora_rank), None)
        if fit is None:
            raise launcher.LaunchError(
                f"vLLM serves LoRA adapters of rank <= {LORA_RANKS[-1]} (got {lora_rank})"
            )
        cmd += ["--enable-lora", "--max-lora-rank", str(fit), "--max-loras", "1"]
    cmd += ["--middleware", MIDDLEWARE]  # the key on every path (loaded from GUARD_DIR: server_env)
    return cmd + list(args.extra_args)


def server_env(args: VLLMBackendArgs, index: int, lora: bool = False) -> dict[str, str]:
    """Dev endpoints on (weight updates); with several servers, server i gets GPUs i*tp ... (i+1)*tp-1
    of those visible (with `devices`, the launcher gives it its share instead). With `cpus`, vLLM's CPU
    workers bind their OpenMP threads to the server's share (one part per tensor-parallel rank) instead
    of choosing cores themselves. PYTHONPATH starts with the folder of our key guard (--middleware), which
    vLLM's own Python environment imports from there (arealcli is not installed in it)."""
    inherited = os.environ.get("PYTHONPATH")
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONPATH": str(GUARD_DIR) + (os.pathsep + inherited if inherited else ""),
    }
    if lora:  # /v1/load_lora_adapter: the adapter updates
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    cpus = args.server_cpus(index)
    if cpus:
        tp = args.tensor_parallel_size
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(compact(share(cpus, r, tp)) for r in range(tp))
    if args.num_servers > 1 and args.devices is None:
        tp = args.tensor_parallel_size
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(args.num_servers * tp)]
        mine = ids[index * tp : (index + 1) * tp]
        if len(mine) < tp:
            raise launcher.LaunchError(
                f"{args.num_servers} servers x tensor_parallel_size {tp} need more GPUs than "
                f"CUDA_VISIBLE_DEVICES={visible!r} lists"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


class VLLMBackend(SGLangBackend):
    """Generation on vLLM servers (OpenAI-compatible API): connect to `addresses` or `launch` them."""

    Args = VLLMBackendArgs
    merges_adapters = False  # vLLM serves a LoRA adapter apart from the base

    @property
    def applies_adapter_updates(self) -> bool:
        """Launched servers following a LoRA model take its adapters alone (vLLM's LoRA support)."""
        a = self.args
        return a.launch and a.lora_updates == "adapters" and self.source_lora is not None

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        a: VLLMBackendArgs = self.args
        try:
            addresses = self._launch(model, spec) if a.launch else list(a.addresses)
            key = self.api_key if a.launch else a.key()
            adapter = model.name if self.applies_adapter_updates else None  # served under the model's name
            self.client = VLLMClient(
                addresses, **a.client_options(), supervisor=self.supervisor, api_key=key, adapter=adapter
            )
            self.loop = EventLoopThread()
            self.loop.run(self.client.check_all())
            if a.launch:
                self.loop.run(self.client.warm_up(a.startup_timeout_s))
        except BaseException:
            self.destroy(model)
            raise
        model.module = VLLMEngine(self.client, self.loop, model.name)
        return model

    def _launch(self, model: Model, spec: FinetuneSpec) -> list[str]:
        a: VLLMBackendArgs = self.args
        if spec.run_dir is not None:
            root = Path(spec.run_dir)
        else:
            self._tmp_dir = tempfile.mkdtemp(prefix="arealcli-servers-")
            root = Path(self._tmp_dir)
        weights = (root / "weights" / model.name / "init").resolve()
        export_hf(model.initial_module(), model.tokenizer, weights)
        python = a.python_executable or os.environ.get(PYTHON_ENV) or "python"
        rank = self.source_lora.rank if self.applies_adapter_updates else None
        atexit.register(self._stop_servers)  # also when the trainer never reaches destroy()
        self.api_key = fresh_key()
        self.servers = launcher.launch(
            a,
            str(weights),
            root / "servers",
            model.name,
            command=lambda port, i: server_command(a, python, str(weights), port, rank),
            extra_env=lambda i: server_env(a, i, lora=rank is not None),
            secrets={VLLM_API_KEY_ENV: self.api_key},  # vLLM's own variable: its /v1 routes want it
        )
        launcher.wait_ready(self.servers, a.startup_timeout_s)
        self._supervise(model.name)
        return [s.address for s in self.servers]
