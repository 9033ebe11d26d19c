"""Helpers for tests that need torch.distributed on CPU (gloo), and the worker they launch.

``launch_workers`` starts N copies of this file as plain processes (RANK / WORLD_SIZE / MASTER_* in
the environment, as torchrun would set them). Run as a script, the file is the megatron worker: for
each TP x PP layout it builds every model found in the work directory, loads its HF weights through
``hf_to_megatron``, runs the forward pass (pipeline stages by hand with send / recv), gathers the TP
logits and saves them for the test to compare with HF.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_world_of_one() -> Iterator[None]:
    """torch.distributed initialised in this process as a gloo world of size 1; torn down after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def launch_workers(
    nprocs: int, args: list[str], timeout_s: float = 120, script: str = __file__, env: dict | None = None
) -> None:
    """Run `script` (default: this file) as ``nprocs`` ranks of one gloo world; raise with their output
    if any fails."""
    env_base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nprocs),
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, script, *args],
            env={**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(nprocs)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n{out[-6000:]}" for r, out in enumerate(outputs))
        raise RuntimeError(f"distributed workers failed (rank, exit code): {failed}\n{logs}")


# ---------------------------------------------------------------------------------------------
# Worker (run as a script)
# ---------------------------------------------------------------------------------------------


def _forward_logits(model, input_ids):  # noqa: ANN001, ANN202
    """Full-vocab logits [b, s, padded_vocab] on the last stage (None elsewhere)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = input_ids.shape
    position_ids = torch.arange(s).expand(b, s)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype)  # [s, b, h]
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(input_ids, position_ids, None)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)  # [b, s, V/tp] x tp -> [b, s, V]


def leave_world(code: int = 0) -> None:
    """End a test's worker process: leave the process group, then exit without interpreter teardown.

    gloo's worker threads can still hold tensors when Python finalizes; destroying them then aborts
    the process now and then ("terminate called without an active exception") after all its work is
    done and written. A worker's result is on disk by this point, so nothing is lost by skipping it.
    """
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _worker(workdir: Path, layouts: list[tuple[int, int]], attentions: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from arealcli.runtime.backends.megatron.convert import hf_to_megatron
    from arealcli.runtime.backends.megatron.model import build_gpt_model, destroy_parallel, init_parallel

    dist.init_process_group("gloo")
    input_ids = torch.load(workdir / "input_ids.pt")
    model_dirs = sorted(p for p in workdir.iterdir() if p.is_dir())
    for tp, pp in layouts:
        init_parallel(tp, pp)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        for model_dir in model_dirs:
            hf_config = AutoConfig.from_pretrained(model_dir)
            hf_state = torch.load(model_dir / "hf_state.pt")
            shard = hf_to_megatron(hf_state, hf_config, tp_rank, tp, pp_rank, pp)
            for attention in attentions:
                model = build_gpt_model(hf_config, attention=attention).eval()
                if list(shard) != list(model.state_dict()):
                    raise AssertionError(f"key mismatch: {set(shard) ^ set(model.state_dict())}")
                model.load_state_dict(shard, strict=True)
                with torch.no_grad():
                    logits = _forward_logits(model, input_ids)
                if logits is not None and tp_rank == 0:
                    name = f"{model_dir.name}_{attention}_tp{tp}pp{pp}.pt"
                    torch.save(logits[..., : hf_config.vocab_size].clone(), workdir / name)
        destroy_parallel()
    leave_world()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--layouts", default="2x1,1x2", help="comma-separated TPxPP")
    parser.add_argument("--attentions", default="sdpa,local")
    a = parser.parse_args()
    _worker(
        a.workdir,
        [tuple(int(x) for x in layout.split("x")) for layout in a.layouts.split(",")],
        a.attentions.split(","),
    )
