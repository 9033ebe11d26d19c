"""Weight sync cost: from the end of a training step to the generator serving the new weights, at the
Qwen2-0.5B shape, for each kind of generator.

The trained model is built from its config (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864,
vocab 151936) with random weights, fp32, on the hf backend, as `areal train` builds it; a training step
is stood in for by changing every weight in place (what an optimizer step does to them). Then, timed:

    sync        the trainer's own `WeightSync.sync` until the follower says it holds the new weights:
                local: a copy of the tensors in memory; embedded / vllm: an HF export to disk (timed
                apart as `export`) and the server's reload from it
    first token one greedy 1-token request answered by the new weights (its weight version checked)
    total       sync + first token: the step's end to the new weights serving

Generators: `local` (in-process, `backend: local`), `embedded` (an `areal serve` process launched by the
sglang backend, `launch: embedded`), `vllm` (vLLM's CPU build launched by the vllm backend; needs a
python with vllm: --vllm-python or env AREALCLI_VLLM_PYTHON, else it is skipped with the reason). With
`--lora R`, the trained model has LoRA adapters of rank R on every linear layer: `local` then receives
the adapters alone in memory, `embedded` the adapters alone on disk (its server merges them into its copy
of the base: `lora_updates: adapters`), `embedded-merged` the merged weights every time (`lora_updates:
merged`, the row to compare with), `vllm` the adapters alone (vLLM's LoRA support, reloaded in place by
name), `vllm-merged` the merged weights. `moved` is what one update sends.

    python bench/weight_sync.py                               # local, embedded, vllm; 3 updates each
    python bench/weight_sync.py --only local --lora 16
    python bench/weight_sync.py --lora 8 --only embedded embedded-merged   # adapter-only against merged
    python bench/weight_sync.py --lora 8 --only vllm vllm-merged
    python bench/weight_sync.py --only embedded --untied --repeats 5

Qwen2-0.5B ties its output layer to the embeddings; vLLM's CPU build cannot reload a tied output layer in
place, so its row always runs the untied shape (136M more parameters), and `--untied` gives every row
that shape. `other load` is the share of the machine's cores other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from lora_memory import QWEN2_0_5B  # noqa: E402  (the Qwen2-0.5B layer shapes, one copy)

SHAPE = {
    **{k: v for k, v in QWEN2_0_5B.items() if k != "tie_word_embeddings"},
    "max_position_embeddings": 512,
}


def build_module(tied: bool, tokenizer):
    """The model as built from its config: random weights (seed 0), fp32."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPE, tie_word_embeddings=tied, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config)


def build_source(module, lora: int | None, tokenizer):
    """The trained model: hf backend, CPU, fp32 (LoRA adapters on every linear layer with `lora`)."""
    from arealcli.runtime.backends.hf import HFBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import HFBackendArgs

    args: dict = {"device": "cpu"}
    if lora is not None:
        args.update(optimizer={"lr": 1e-5}, lora={"rank": lora, "alpha": 2.0 * lora})
    return HFBackend(HFBackendArgs.model_validate(args)).initialize(
        Model("actor", module, tokenizer), FinetuneSpec(1, 1, 1, 10)
    )


def build_follower(
    kind: str, source_module, tokenizer, run_dir: Path, vllm_python: str | None, lora: int | None
):
    import copy

    from arealcli.runtime.backends.local import LocalBackend
    from arealcli.runtime.backends.sglang import SGLangBackend
    from arealcli.runtime.backends.vllm import VLLMBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import LocalBackendArgs, SGLangBackendArgs, VLLMBackendArgs
    from arealcli.schema.components.engine import LoraConfig

    spec = FinetuneSpec(1, 1, 1, 10, run_dir=str(run_dir))
    if kind == "local":
        backend = LocalBackend(LocalBackendArgs(device="cpu", num_threads=0))
        return backend.initialize(Model("gen", copy.deepcopy(source_module), tokenizer), spec)
    if kind in ("embedded", "embedded-merged"):
        updates = "merged" if kind == "embedded-merged" else "adapters"
        backend = SGLangBackend(
            SGLangBackendArgs(launch="embedded", device="cpu", startup_timeout_s=900, lora_updates=updates)
        )
        return backend.initialize(Model("gen", source_module, tokenizer), spec)
    args = VLLMBackendArgs(
        launch=True,
        python_executable=vllm_python,
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        startup_timeout_s=900,
        request_timeout_s=900,
        lora_updates="merged" if kind == "vllm-merged" else "adapters",
    )
    backend = VLLMBackend(args)
    if lora is not None:  # what the trainer tells a follower of a LoRA model
        backend.source_lora = LoraConfig(rank=lora, alpha=2.0 * lora)
    return backend.initialize(Model("gen", source_module, tokenizer), spec)


def step(source) -> None:
    """Stand-in for an optimizer step: every trained weight changes in place."""
    import torch

    with torch.no_grad():
        for p in source.module.module.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p), alpha=1e-3)
    source.inc_version()


def other_load(before, after) -> float:
    busy, total, own = (a - b for a, b in zip(after, before, strict=True))
    return max(0.0, (busy - own) / total) if total > 0 else 0.0


def measure(kind: str, args, tokenizer) -> dict:
    import torch

    from arealcli.runtime.run import threads
    from arealcli.runtime.run.weight_sync import WeightSync
    from arealcli.schema.components.engine import GenerationHyperparameters

    tied = not args.untied and not kind.startswith("vllm")
    module = build_module(tied, tokenizer)
    params = sum(p.numel() for p in module.parameters())
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        run_dir = Path(tmp)
        t0 = time.perf_counter()  # the follower starts from the weights as built, as with `init_from`
        follower = build_follower(kind, module, tokenizer, run_dir, args.vllm_python, args.lora)
        ready_s = time.perf_counter() - t0
        source = build_source(module, args.lora, tokenizer)
        recipe = SimpleNamespace(
            models={"actor": SimpleNamespace(weights_from=None), "gen": SimpleNamespace(weights_from="actor")}
        )
        sync = WeightSync(recipe, {"actor": source, "gen": follower}, tokenizer, run_dir)  # type: ignore[arg-type]
        exports: list[float] = []

        def timed(real):
            def export(src: str, version: int, **kw) -> tuple[Path, int]:
                t = time.perf_counter()
                try:
                    return real(src, version, **kw)
                finally:
                    exports.append(time.perf_counter() - t)

            return export

        sync.export = timed(sync.export)  # type: ignore[method-assign]
        sync.export_adapters = timed(sync.export_adapters)  # type: ignore[method-assign]
        g = GenerationHyperparameters(greedy=True, max_new_tokens=1)
        eos = {tokenizer.eos_token_id}
        rows = []
        sent: list[float] = []
        moved_by = "on disk"
        load0 = threads._sample()
        try:
            sync.sync()  # the first update (LoRA: base and adapters): not timed
            follower.module.submit_group([20, 21, 22], g, eos, 1).result(timeout=900)
            for _ in range(args.repeats):
                step(source)
                version = source.version.global_step
                exports.clear()
                t_end = time.perf_counter()
                stats = sync.sync({"actor": version - 1})
                t_synced = time.perf_counter()
                if "weight_sync/actor_bytes" in stats:  # what went to the follower through disk
                    sent.append(stats["weight_sync/actor_bytes"])
                (sample,) = follower.module.submit_group([20, 21, 22], g, eos, 1).result(timeout=900)
                t_served = time.perf_counter()
                assert sample.versions() == (version, version), sample.versions()
                rows.append((t_synced - t_end, t_served - t_synced, t_served - t_end, sum(exports)))
                if sync.whole.get("actor"):  # what went to the follower in memory
                    sent.append(sync.weights_for("actor", "gen").nbytes())
                    moved_by = "in memory"
            load1 = threads._sample()
        finally:
            follower.backend.destroy(follower)
        del follower, source, module
        gc.collect()
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    dtype = "bf16 (served), fp32 export" if kind.startswith("vllm") else "fp32"
    moved = f"{statistics.median(sent) / 2**20:.1f} MiB {moved_by}" if sent else "?"
    return {
        "generator": kind + (f" (LoRA r={args.lora})" if args.lora else ""),
        "params": f"{params / 1e6:.0f}M" + (" tied" if tied else " untied"),
        "dtype": dtype,
        "moved": moved,
        "sync_s": med[0],
        "export_s": med[3],
        "first_token_s": med[1],
        "total_s": med[2],
        "ready_s": ready_s,
        "other_load": other_load(load0, load1) if load0 and load1 else float("nan"),
        "threads": torch.get_num_threads(),
    }


def vllm_python(given: str | None) -> tuple[str | None, str]:
    import subprocess

    python = given or os.environ.get("AREALCLI_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        return None, f"{python} does not exist"
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    return (python, "") if probe.returncode == 0 else (None, f"vllm does not import: {probe.stderr[-200:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["local", "embedded", "embedded-merged", "vllm", "vllm-merged"],
        default=None,
    )
    parser.add_argument("--repeats", type=int, default=3, help="Timed updates per generator (median shown).")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK", help="LoRA adapters of this rank.")
    parser.add_argument("--untied", action="store_true", help="An untied output layer in every row.")
    parser.add_argument("--vllm-python", default=None, help="A python with vllm (default: .venv-vllm).")
    args = parser.parse_args()

    from transformers.utils import logging as hf_logging

    from arealcli.runtime.data.tokenizer import char_tokenizer

    hf_logging.disable_progress_bar()
    tokenizer = char_tokenizer()
    kinds = args.only or ["local", "embedded", "vllm"]
    if args.lora and args.only is None:
        kinds.insert(2, "embedded-merged")
        kinds.append("vllm-merged")
    results, skipped = [], []
    for kind in kinds:
        if kind.startswith("vllm"):
            args.vllm_python, why = vllm_python(args.vllm_python)
            if args.vllm_python is None:
                skipped.append(f"vllm: skipped ({why})")
                continue
        print(f"measuring {kind} ...", file=sys.stderr, flush=True)
        results.append(measure(kind, args, tokenizer))
    head = (
        "generator",
        "params",
        "dtype",
        "moved",
        "sync s",
        "export s",
        "1st token s",
        "total s",
        "other load",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        print(
            f"| {r['generator']} | {r['params']} | {r['dtype']} | {r['moved']} | {r['sync_s']:.2f} | "
            f"{r['export_s']:.2f} | {r['first_token_s']:.2f} | {r['total_s']:.2f} | {r['other_load']:.0%} |"
        )
    for line in skipped:
        print(line)
    print(
        f"(median of {args.repeats} updates; torch threads {results[0]['threads'] if results else '-'}; "
        "generator start-up, not in the totals: "
        + ", ".join(f"{r['generator']} {r['ready_s']:.0f} s" for r in results)
        + ")"
    )


if __name__ == "__main__":
    main()
