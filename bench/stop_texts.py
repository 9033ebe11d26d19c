"""What stop texts cost while generating, side by side in one run: no stop text, a stop text checked
through the per-token pre-filter (the common case), and one ending in whitespace (no pre-filter: the
decoded tail of every running sample is searched after every token).

The quickstart actor's shape (Qwen2, hidden 128, 2 layers, char tokenizer) with random weights; every
sample runs `--max-new-tokens` (EOS ignored; the stop texts never occur: three characters in a row that
random sampling does not produce in practice — checked: the counts of stopped samples are printed).
The three settings take turns batch by batch, so a load spike hits them all.

    python bench/stop_texts.py                  # 64 prompts x 128 tokens, 3 timed batches each
    python bench/stop_texts.py --batch 256 --max-new-tokens 64 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from arealcli.runtime.data.tokenizer import char_tokenizer
    from arealcli.runtime.generation import sampling as generation
    from arealcli.runtime.models.model import hf_config_from_arch
    from arealcli.schema.components.engine import GenerationHyperparameters
    from arealcli.schema.recipe import ModelArchConfig

    arch = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())["models"]["actor"]["config"]
    arch = {**arch, "max_position_embeddings": 64 + args.max_new_tokens}
    tok = char_tokenizer()
    torch.manual_seed(1)
    module = AutoModelForCausalLM.from_config(hf_config_from_arch(ModelArchConfig(**arch), tok)).eval()
    prompts = [tok(f"max({i},{i * 7 % 100},{i * 13 % 100})=")["input_ids"] for i in range(args.batch)]
    g = GenerationHyperparameters(max_new_tokens=args.max_new_tokens)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    settings = {
        "no stop text": None,
        "stop 'zq#' (pre-filtered)": ["zq#"],
        "stop 'zq ' (no pre-filter)": ["zq "],
    }
    times: dict[str, list[float]] = {name: [] for name in settings}
    stopped: dict[str, int] = dict.fromkeys(settings, 0)
    for r in range(args.repeats + 1):  # the first round warms up
        for name, texts in settings.items():
            stop = generation.StopTexts(texts, decode) if texts else None
            torch.manual_seed(r)
            t0 = time.perf_counter()
            out = generation.generate(module, prompts, g, set(), tok.pad_token_id, "cpu", stop_texts=stop)
            if r:
                times[name].append(time.perf_counter() - t0)
                stopped[name] += sum(len(ids) < args.max_new_tokens for ids in out.output_ids)

    tokens = args.batch * args.max_new_tokens
    base = statistics.median(times["no stop text"])
    print(
        f"{args.batch} samples x {args.max_new_tokens} tokens, {args.threads} threads, {args.repeats} timed batches"
    )
    print(f"{'setting':<30} {'tokens/s':>10} {'vs none':>8} {'stopped':>8}")
    for name in settings:
        t = statistics.median(times[name])
        print(f"{name:<30} {tokens / t:>10.0f} {base / t:>7.2f}x {stopped[name]:>8}")


if __name__ == "__main__":
    main()
