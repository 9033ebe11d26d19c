"""Model FLOPs (models/flops.py) against torch's own count of the matmuls a real forward and backward
run, and the compute line of the training summary."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_module
from torch.utils.flop_counter import FlopCounterMode

from arealcli.runtime.models import flops


@pytest.mark.parametrize("tied", [True, False])
def test_the_formula_counts_what_torch_counts(char_tok, tied):
    """2 N T + 4 L H sum(l^2) forward, 3x that with backward: within 2% of torch's FlopCounterMode on
    a real model (eager attention: the full l x l scores, as the formula counts them). What is left is
    bias adds and norms, which the counter does not count."""
    module = tiny_module(char_tok, tie_word_embeddings=tied)
    module.config._attn_implementation = "eager"  # the full l x l scores as matmuls torch counts
    shape = flops.shape_of(module)
    assert shape is not None and shape.layers == module.config.num_hidden_layers
    lens = [48, 17]
    counted_fwd = counted_train = 0
    for n in lens:  # one sequence at a time: no padding
        ids = torch.randint(0, module.config.vocab_size, (1, n))
        with FlopCounterMode(display=False) as fwd:
            module(input_ids=ids)
        counted_fwd += fwd.get_total_flops()
        with FlopCounterMode(display=False) as both:
            module(input_ids=ids).logits.sum().backward()
        counted_train += both.get_total_flops()
    assert flops.forward_flops(shape, lens) == pytest.approx(counted_fwd, rel=0.02)
    assert flops.train_flops(shape, lens) == pytest.approx(counted_train, rel=0.02)


def test_the_summary_says_the_share_of_peak(tmp_path):
    import json

    from arealcli.runtime.console.report import summary_lines

    rows = [
        {"step": s, "timing/step_s": 2.0, "timing/actor_train_s": 1.0, "perf/actor_train_gflop": 30.0}
        for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = dict(summary_lines(tmp_path, 4.0, 2, peaks=lambda: {"fp32": 100e9}))
    assert lines["compute"] == (
        "whole steps 15 GFLOP/s = 15.0% of peak; actor_train 30 GFLOP/s = 30.0% of peak"
    )
    assert "fp32 100 GFLOP/s" in lines["peak"]
    assert "peak" not in dict(summary_lines(tmp_path))  # areal report: no measurement


def test_a_run_logs_its_calls_flops_and_says_its_share_of_peak(ws, cli):
    """Every call that computes in the training process logs `perf/<call>_gflop`; the summary says the
    rate and the share of the matmul peak measured after the run."""
    import json

    run = ws.root / "run"
    result = cli("train", ws.recipe(trainer={"max_steps": 2, "tensorboard": False}), "-o", run)
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    gflop = [v for r in rows for k, v in r.items() if k.startswith("perf/") and k.endswith("_gflop")]
    assert gflop and all(v > 0 for v in gflop)
    out = " ".join(result.output.split())
    assert "compute whole steps" in out and "% of peak" in out and "peak matmul on these cores" in out
