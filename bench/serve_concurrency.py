"""`areal serve` under agent-like load: many concurrent single-sample `/v1/completions` requests against
the same samples sent as a few requests with `n`, side by side in one run (and the same two loads against
vLLM's CPU build serving the same model, when `.venv-vllm/bin/python` exists).

Same tiny model as `generation_throughput.py` (the quickstart's Qwen2 shape, untied embeddings, random
weights, char tokenizer). Prompts: the first `--requests / --n` rows of data/max3/train.jsonl, as text.
Every completion is exactly `--max-tokens` long (min_tokens = max_tokens), temperature 1.

    single:  --requests requests with n = 1 (each prompt --n times), all sent at once
    grouped: --requests / --n requests with n = --n, all sent at once

The servers run one at a time (an idle vLLM engine keeps using CPU). Each round sends `single` then
`grouped`; the first `--warmup` rounds are not timed. Rates are new tokens (counted from the responses'
`usage`) over the wall time from the first request sent to the last answer read. `fwd` is the embedded
server's count of model forward passes in a round (`/get_server_info`), `cpu c/s` the CPU seconds this
process (the client) and the server used in a round, `other load` the CPU share that other processes
used meanwhile, `loadavg` /proc/loadavg's 1-minute figure before and after.

    python bench/serve_concurrency.py                     # 256 x n=1 vs 32 x n=8, 8 tokens, 3 rounds
    python bench/serve_concurrency.py --threads 1 --no-vllm --repeats 2
    python bench/serve_concurrency.py --client openai     # the same loads sent by the openai package

A third load, `mixed` (skipped with --no-mixed), sends single-sample requests that differ: the same
prompts in --n waves 30 ms apart, each request 4-64 tokens long (max_tokens = min_tokens); its table
gives new tokens/s, the mean time from a request sent to its answer, and the forward passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from generation_throughput import ROOT, VLLM_PYTHON, cpu_clock, save_model

from arealcli.runtime.clients import launcher


class Client:
    """One HTTP client library sending completions: `aiohttp` (one session, no connection cap), `openai`
    (the openai package's AsyncOpenAI, as agent code uses it) or `httpx` (httpx.AsyncClient, no cap)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._openai: dict[str, Any] = {}
        if kind == "aiohttp":
            connector = aiohttp.TCPConnector(limit=0)  # every request in flight at once
            self.session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=600)
            )
        elif kind == "httpx":
            import httpx

            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self.httpx = httpx.AsyncClient(timeout=600, limits=limits, trust_env=False)

    async def model(self, address: str) -> str:
        """The served model's name (/v1/models)."""
        async with aiohttp.ClientSession() as s, s.get(f"http://{address}/v1/models") as r:
            return (await r.json())["data"][0]["id"]

    async def complete(self, address: str, body: dict) -> int:
        """Post one completion request; the new tokens in its answer."""
        url = f"http://{address}/v1/completions"
        if self.kind == "aiohttp":
            async with self.session.post(url, json=body) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {text[:300]}")
                return json.loads(text)["usage"]["completion_tokens"]
        if self.kind == "httpx":
            r = await self.httpx.post(url, json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        if address not in self._openai:
            from openai import AsyncOpenAI

            self._openai[address] = AsyncOpenAI(
                base_url=f"http://{address}/v1", api_key="none", max_retries=0
            )
        extra = {"min_tokens": body["min_tokens"]}
        kwargs = {k: v for k, v in body.items() if k != "min_tokens"}
        out = await self._openai[address].completions.create(**kwargs, extra_body=extra, timeout=600)
        return out.usage.completion_tokens

    async def close(self) -> None:
        if self.kind == "aiohttp":
            await self.session.close()
        elif self.kind == "httpx":
            await self.httpx.aclose()
        for c in self._openai.values():
            await c.close()


async def send_all(client: Client, address: str, bodies: list[dict]) -> tuple[float, int]:
    """Post every body at once; (seconds until the last answer, new tokens in the answers)."""
    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(client.complete(address, b) for b in bodies))
    return time.perf_counter() - t0, sum(tokens)


async def send_waves(
    client: Client, address: str, timed: list[tuple[float, dict]]
) -> tuple[float, int, float]:
    """Post each body `delay` seconds after the start; (seconds until the last answer, new tokens, mean
    seconds from a request sent to its answer)."""

    async def one(delay: float, body: dict) -> tuple[int, float]:
        await asyncio.sleep(delay)
        t = time.perf_counter()
        return await client.complete(address, body), time.perf_counter() - t

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(d, b) for d, b in timed))
    return time.perf_counter() - t0, sum(n for n, _ in out), statistics.mean(t for _, t in out)


MIXED = "mixed"


def mixed_load(prompts: list[str], n: int, model: str, seed: int) -> list[tuple[float, dict]]:
    """Single-sample requests that differ, as agents' do: the prompts in `n` waves 30 ms apart, each
    request 4-64 tokens long (max_tokens = min_tokens, drawn with `seed`)."""
    rng = random.Random(seed)
    out = []
    for wave in range(n):
        for p in prompts:
            t = rng.randint(4, 64)
            body = {"model": model, "prompt": p, "max_tokens": t, "min_tokens": t, "temperature": 1.0, "n": 1}
            out.append((0.03 * wave, body))
    return out


async def server_stats(address: str) -> dict[str, int] | None:
    """The embedded server's counters (forward passes, samples, ...); None for other servers."""
    async with aiohttp.ClientSession() as s, s.get(f"http://{address}/get_server_info") as r:
        if r.status != 200:
            return None
        info = await r.json()
        states = info.get("internal_states") if isinstance(info, dict) else None
        return states[0] if states and "forwards" in states[0] else None


def loads(prompts: list[str], n: int, max_tokens: int, model: str) -> dict[str, list[dict]]:
    """The two loads over the same samples: each prompt n times as n = 1 requests, or once with n."""
    common = {"model": model, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 1.0}
    return {
        f"{len(prompts) * n} x n=1": [{**common, "prompt": p, "n": 1} for p in prompts for _ in range(n)],
        f"{len(prompts)} x n={n}": [{**common, "prompt": p, "n": n} for p in prompts],
    }


def start_ours(args, model_dir: Path, log_dir: Path) -> launcher.ServerProcess:
    from arealcli.schema.components.backends import SGLangBackendArgs

    extra = ["--num-threads", str(args.threads), "--max-batch-size", str(args.requests)]
    ours = SGLangBackendArgs(launch="embedded", num_servers=1, device="cpu", extra_args=extra)
    servers = launcher.launch(ours, str(model_dir), log_dir, "areal")
    launcher.wait_ready(servers, 120)
    return servers[0]


def start_vllm(args, model_dir: Path, log_dir: Path) -> launcher.ServerProcess | None:
    """vLLM's server when its venv exists and it starts (it is optional: why not is printed)."""
    from arealcli.runtime.backends.vllm import server_command
    from arealcli.schema.components.backends import VLLMBackendArgs

    if args.no_vllm or not VLLM_PYTHON.exists():
        print(f"vllm: skipped ({'--no-vllm' if args.no_vllm else f'no {VLLM_PYTHON}'})")
        return None
    va = VLLMBackendArgs(
        launch=True,
        python_executable=str(VLLM_PYTHON),
        dtype="float32",
        max_model_len=args.max_len,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
    )
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    servers = launcher.launch(
        va,
        str(model_dir),
        log_dir,
        "vllm",
        command=lambda port, i: server_command(va, str(VLLM_PYTHON), str(model_dir), port),
        extra_env=lambda i: env,
    )
    try:
        launcher.wait_ready(servers, 300)
    except launcher.LaunchError as e:
        launcher.stop(servers)
        print(f"vllm: skipped, it did not start: {str(e)[-600:]}")
        return None
    return servers[0]


async def measure(args, name: str, server: launcher.ServerProcess, prompts: list[str], res: dict) -> None:
    """The timed rounds against one server, added to `res`."""
    times, forwards, cpu, clock = res["times"], res["forwards"], res["cpu"], res["clock"]
    clock[name] = [0.0, 0.0, 0.0]
    client = Client(args.client)
    try:
        model = await client.model(server.address)
        for rnd in range(args.warmup + args.repeats):
            for load, bodies in loads(prompts, args.n, args.max_tokens, model).items():
                before = await server_stats(server.address)
                a, own = cpu_clock(), time.process_time()
                dt, tokens = await send_all(client, server.address, bodies)
                b, own = cpu_clock(), time.process_time() - own
                after = await server_stats(server.address)
                if rnd < args.warmup:
                    continue
                times.setdefault((name, load), []).append((dt, tokens))
                if before is not None and after is not None:
                    forwards.setdefault((name, load), []).append(after["forwards"] - before["forwards"])
                if a is not None and b is not None:
                    clock[name] = [s + y - x for s, x, y in zip(clock[name], a, b, strict=True)]
                    cpu.setdefault((name, load), []).append((own, b[2] - a[2] - own))
            if args.no_mixed:
                continue
            before = await server_stats(server.address)
            dt, tokens, latency = await send_waves(
                client, server.address, mixed_load(prompts, args.n, model, rnd)
            )
            after = await server_stats(server.address)
            if rnd >= args.warmup:
                res["mixed"].setdefault(name, []).append(
                    (
                        tokens / dt,
                        latency,
                        None if before is None or after is None else after["forwards"] - before["forwards"],
                    )
                )
    finally:
        await client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256, help="samples per load (single-sample requests)")
    p.add_argument("--n", type=int, default=8, help="samples per request in the grouped load")
    p.add_argument("--max-tokens", type=int, default=8, help="every completion has exactly this many")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed first rounds")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each server")
    p.add_argument("--no-vllm", action="store_true", help="skip the vllm server")
    p.add_argument("--client", choices=["aiohttp", "openai", "httpx"], default="aiohttp", help="HTTP client")
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed load")
    args = p.parse_args()
    if args.requests % args.n:
        p.error("--requests must be a multiple of --n")

    rows = [json.loads(line) for line in (ROOT / "data" / "max3" / "train.jsonl").open()]
    prompts = [r["prompt"] for r in rows[: args.requests // args.n]]
    args.max_len = max(64, max(len(x) for x in prompts) + max(args.max_tokens, 64) + 8)  # mixed: <= 64
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "model", args.max_len)
        res: dict[str, Any] = {
            "times": {},
            "forwards": {},
            "cpu": {},
            "clock": {},
            "loadavg": {},
            "mixed": {},
        }
        for name, start in (("areal serve", start_ours), ("vllm", start_vllm)):
            server = start(args, Path(tmp) / "model", Path(tmp) / "logs")
            if server is None:
                continue
            try:
                before = Path("/proc/loadavg").read_text().split()[0]
                asyncio.run(measure(args, name, server, prompts, res))
                res["loadavg"][name] = f"{before} -> {Path('/proc/loadavg').read_text().split()[0]}"
            finally:
                launcher.stop([server])

    print(
        f"\n{args.requests} samples x {args.max_tokens} new tokens; {os.cpu_count()} CPUs, {args.threads} "
        f"torch threads per server; client {args.client}; {args.repeats} timed rounds after {args.warmup} "
        f"warm-up; one server at a time"
    )
    names = list(loads(prompts, args.n, args.max_tokens, "").keys())
    head = (
        f"{'server':<14}"
        + "".join(f"{x + ' tok/s':>18}" for x in names)
        + f"{'ratio':>8}"
        + "".join(f"{x + ' fwd':>16}" for x in names)
        + "".join(f"{x + ' cpu c/s':>20}" for x in names)
        + f"{'other load':>12}"
        + f"{'loadavg':>16}"
    )
    print(head + "\n" + "-" * len(head))
    for name in res["clock"]:
        rates = [statistics.median(tok / dt for dt, tok in res["times"][(name, load)]) for load in names]
        fwd = [res["forwards"].get((name, load)) for load in names]
        cpu = []
        for load in names:
            runs = res["cpu"].get((name, load))
            cpu.append(
                "?" if not runs else "/".join(f"{statistics.median(r[k] for r in runs):.2f}" for k in (0, 1))
            )
        wall, busy, ours = res["clock"][name]
        other = max(0.0, (busy - ours) / (wall * (os.cpu_count() or 1))) if wall else None
        print(
            f"{name:<14}"
            + "".join(f"{r:>18.0f}" for r in rates)
            + f"{rates[0] / rates[1]:>8.2f}"
            + "".join(f"{'-' if f is None else ','.join(map(str, f)):>16}" for f in fwd)
            + "".join(f"{c:>20}" for c in cpu)
            + f"{'?' if other is None else f'{other:.0%}':>12}"
            + f"{res['loadavg'][name]:>16}"
        )
    print("ratio: single-sample rate / grouped rate (the goal is >= 0.5)")
    print("fwd: the server's model forward passes in each timed round (prefills + decoding steps)")
    print("cpu c/s: CPU seconds of the client (this process) / of the server in a round (medians)")
    print("other load: CPU share used by other processes meanwhile; above ~10% the run is not a result")
    print("loadavg: /proc/loadavg's 1-minute figure before -> after the server's rounds")
    if res["mixed"]:
        print(
            f"\nmixed: {args.requests} single-sample requests in {args.n} waves 30 ms apart, 4-64 tokens each"
        )
        print(f"{'server':<14}{'tok/s':>10}{'latency s':>12}{'fwd':>24}")
        for name, runs in res["mixed"].items():
            fwd = ",".join("-" if f is None else str(f) for _, _, f in runs)
            tps = statistics.median(r[0] for r in runs)
            print(f"{name:<14}{tps:>10.0f}{statistics.median(r[1] for r in runs):>12.3f}{fwd:>24}")
        print("latency: mean seconds from a request sent to its answer (median round)")


if __name__ == "__main__":
    main()
