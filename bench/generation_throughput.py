"""Generation throughput, side by side: in-process `hf` vs the `sglang` backend on 1 and 2 embedded
`areal serve` servers (vs the `vllm` backend when `.venv-vllm/bin/python` exists), one run.

Same tiny model (the quickstart's Qwen2 shape, untied embeddings, random weights, saved once and loaded by
every path), the same prompts (the first `--prompts` rows of data/max3/train.jsonl, each n times), every
completion exactly `--max-new-tokens` long (min_new_tokens = max_new_tokens), temperature 1. In-process is
what the trainer's actor_gen runs (`HFEngine.generate`, one micro-batch); the servers are started by the
backends themselves and stopped by their `destroy`. Paths take turns batch by batch, so a load spike hits
them all; `other load` says whether the machine was quiet enough to trust.

    python bench/generation_throughput.py          # 64 prompts x 8 x 32 tokens, 3 timed batches per path
    python bench/generation_throughput.py --prompts 32 --n 4 --max-new-tokens 16 --repeats 2 --no-vllm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def save_model(directory: Path, max_len: int):
    """The quickstart actor's architecture with random weights, saved with its char tokenizer."""
    from transformers import AutoModelForCausalLM

    from arealcli.runtime.data.tokenizer import char_tokenizer
    from arealcli.runtime.models.model import hf_config_from_arch
    from arealcli.schema.recipe import ModelArchConfig

    arch = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())["models"]["actor"]["config"]
    # head_dim = 128 / 2 heads = 64 (vLLM's CPU attention needs >= 64); untied: vLLM's CPU build needs it
    arch = {**arch, "tie_word_embeddings": False, "max_position_embeddings": max_len}
    tok = char_tokenizer()
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(hf_config_from_arch(ModelArchConfig(**arch), tok)).save_pretrained(
        directory
    )
    tok.save_pretrained(directory)
    return tok


def backends(args, max_len: int) -> list[tuple[str, str, object]]:
    """(path name, threads, backend) of every path to time."""
    from arealcli.runtime.backends.hf import HFBackend
    from arealcli.runtime.backends.sglang import SGLangBackend
    from arealcli.runtime.backends.vllm import VLLMBackend
    from arealcli.schema.components.backends import HFBackendArgs, SGLangBackendArgs, VLLMBackendArgs

    out = [("in-process hf", str(args.threads), HFBackend(HFBackendArgs(device="cpu")))]
    for k in (1, 2):
        per = max(1, args.threads // k)  # the same thread budget in total
        extra = ["--num-threads", str(per), "--max-batch-size", str(args.prompts * args.n)]
        sg = SGLangBackendArgs(launch="embedded", num_servers=k, device="cpu", extra_args=extra)
        out.append((f"sglang, {k} embedded", "+".join([str(per)] * k), SGLangBackend(sg)))
    if args.no_vllm or not VLLM_PYTHON.exists():
        print(f"vllm: skipped ({'--no-vllm' if args.no_vllm else f'no {VLLM_PYTHON}'})")
        return out
    va = VLLMBackendArgs(
        launch=True,
        python_executable=str(VLLM_PYTHON),
        dtype="float32",
        max_model_len=max_len,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        startup_timeout_s=300,
    )
    return out + [("vllm, 1 server", "vllm's", VLLMBackend(va))]


def tree_cpu_s() -> float:
    """CPU seconds used so far by this process and its descendants (the servers it started, theirs)."""
    ppid, ticks = {}, {}
    for d in Path("/proc").iterdir():
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else None
        except OSError:
            continue
        if f:
            ppid[int(d.name)], ticks[int(d.name)] = int(f[1]), int(f[11]) + int(f[12])  # utime + stime
    mine, frontier = set(), [os.getpid()]
    while frontier:
        mine.update(frontier)
        frontier = [p for p, parent in ppid.items() if parent in frontier and p not in mine]
    return sum(ticks.get(p, 0) for p in mine) / os.sysconf("SC_CLK_TCK")


def cpu_clock() -> tuple[float, float, float] | None:
    """(wall s, CPU s used by the whole machine, CPU s used by us and our servers); None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    except OSError:
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait, in clock ticks
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), tree_cpu_s()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32, help="every completion has exactly this many")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per path")
    p.add_argument("--warmup", type=int, default=1, help="untimed first batches per path")
    p.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="in-process; split over servers"
    )
    p.add_argument("--no-vllm", action="store_true", help="skip the vllm path")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from arealcli.runtime.data.sample import SequenceSample
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec

    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the table
    g = GenerationHyperparameters(
        n=args.n, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, temperature=1.0
    )
    rows = [json.loads(line) for line in (ROOT / "data" / "max3" / "train.jsonl").open()][: args.prompts]
    max_len = max(64, max(len(r["prompt"]) for r in rows) + args.max_new_tokens + 8)
    rec: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_model(Path(tmp) / "model", max_len)
        ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        batch = SequenceSample.from_lists(
            list(range(len(ids))), {"packed_prompts": [torch.tensor(x) for x in ids]}
        ).repeat_interleave(args.n)  # as the actor's generate call does: each prompt n times in a row
        models = []
        try:
            for name, threads, backend in backends(args, max_len):
                module = AutoModelForCausalLM.from_pretrained(Path(tmp) / "model", dtype=torch.float32)
                spec = FinetuneSpec(1, args.prompts, args.prompts, 1, str(Path(tmp) / f"run{len(models)}"))
                t0 = time.perf_counter()
                try:
                    models.append((name, backend.initialize(Model("gen", module, tok), spec)))
                except Exception as e:
                    if not name.startswith("vllm"):
                        raise
                    print(f"{name}: skipped, it did not start: {str(e)[:300]}")  # optional path
                    continue
                print(f"{name}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
                rec[name] = {"threads": threads, "times": [], "tokens": [], "clock": [0.0, 0.0, 0.0]}
            for step in range(args.warmup + args.repeats):  # the paths take turns, batch by batch
                for name, model in models:
                    a = cpu_clock()
                    t0 = time.perf_counter()
                    out = model.module.generate(batch, MicroBatchSpec(), tok, g)
                    dt = time.perf_counter() - t0
                    b = cpu_clock()
                    if step < args.warmup:
                        continue
                    r = rec[name]
                    r["times"].append(dt)
                    r["tokens"].append(sum(len(x) for x in out.output_ids))
                    if a is not None and b is not None:
                        r["clock"] = [s + y - x for s, x, y in zip(r["clock"], a, b, strict=True)]
        finally:
            for _, model in models:
                if hasattr(model.backend, "destroy"):
                    model.backend.destroy(model)  # stops the servers it launched

    print(
        f"\n{args.prompts} prompts x {args.n} x {args.max_new_tokens} new tokens; {os.cpu_count()} CPUs;"
        f" {args.repeats} timed batches per path after {args.warmup} warm-up, paths taking turns"
    )
    cols = ["path", "threads", "new tok/s", "s/batch", "x in-proc", "best s", "tokens", "other load"]
    head = f"{cols[0]:<20}{cols[1]:>9}" + "".join(f"{c:>11}" for c in cols[2:])
    print(head + "\n" + "-" * len(head))
    base = None
    for name, r in rec.items():
        sec = statistics.median(r["times"])
        tps = statistics.median(r["tokens"]) / sec  # tokens per batch are equal: the median batch's rate
        base = base or tps
        wall, busy, ours = r["clock"]
        load = max(0.0, (busy - ours) / (wall * (os.cpu_count() or 1))) if wall else None
        print(
            f"{name:<20}{r['threads']:>9}{tps:>11.0f}{sec:>11.3f}{tps / base:>11.2f}{min(r['times']):>11.3f}"
            f"{','.join(map(str, sorted(set(r['tokens'])))):>11}{'?' if load is None else f'{load:.0%}':>11}"
        )
    print("tokens: new tokens per batch (one value = equal work in every timed batch)")
    print("other load: CPU share used by other processes meanwhile; above ~10% the run is not a result")


if __name__ == "__main__":
    main()
