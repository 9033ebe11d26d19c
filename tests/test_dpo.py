"""The `dpo` interface: each preference loss against a hand-computed example, the same loss and gradients
however the pairs are split into micro-batches, a tiny model that learns its preferences (loss falls,
held-out preference accuracy rises, every weight moves, the reference stays), what `areal check` says
of a DPO recipe's mistakes, and what `areal list` shows."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import tiny_module

from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.data.preferences import PreferenceDataset
from arealcli.runtime.interfaces import preference_losses as L
from arealcli.runtime.interfaces.dpo import DPOInterface, num_pairs
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.run.trainer import Trainer
from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.datasets import PreferenceArgs
from arealcli.schema.components.engine import MicroBatchSpec, OptimizerConfig
from arealcli.schema.components.interfaces import REF_LOGPROBS, DPOArgs
from arealcli.schema.source import load_recipe_source
from arealcli.schema.validate import validate
from tests.conftest import toy_pairs, write_jsonl

# --------------------------------------------------------------------------- the losses, by hand

# one pair: logp_c = -1, logp_r = -2, ref_c = ref_r = -1.5, |c| = 2, |r| = 4
# log-ratios: chosen +0.5, rejected -0.5, so h = 1
PAIR = L.Pairs(*(torch.tensor([x]) for x in (-1.0, -2.0, -1.5, -1.5, 2.0, 4.0)))


def softplus(x: float) -> float:
    """-log sigma(-x) = log(1 + e^x)"""
    return math.log1p(math.exp(x))


HAND = {
    # -log sigma(0.1 * 1) = log(1 + e^-0.1)
    "sigmoid": ({"beta": 0.1}, softplus(-0.1)),
    # cDPO: 0.8 log(1 + e^-0.1) + 0.2 log(1 + e^0.1)
    "sigmoid-smoothed": ({"beta": 0.1, "label_smoothing": 0.2}, 0.8 * softplus(-0.1) + 0.2 * softplus(0.1)),
    # max(0, 1 - 0.1)
    "hinge": ({"beta": 0.1}, 0.9),
    # rDPO: (0.8 log(1 + e^-0.1) - 0.2 log(1 + e^0.1)) / 0.6
    "robust": ({"beta": 0.1, "label_smoothing": 0.2}, (0.8 * softplus(-0.1) - 0.2 * softplus(0.1)) / 0.6),
    # h = 0.5 / 2 - (-0.5) / 4 = 0.375; (0.375 - 1 / 0.2)^2
    "ipo": ({"beta": 0.1}, (0.375 - 5.0) ** 2),
    # h = -1/2 - (-2/4) - 0.5 / 2 = -0.25; -log sigma(2 * -0.25) = log(1 + e^0.5)
    "simpo": ({"beta": 2.0, "simpo_gamma": 0.5}, softplus(0.5)),
}


@pytest.mark.parametrize("case", list(HAND))
def test_each_loss_matches_its_formula(case):
    args, expected = HAND[case]
    name = case.split("-")[0]
    loss, chosen, rejected = getattr(L, name)(PAIR, DPOArgs(loss=name, **args))
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    if name == "simpo":  # reference-free: beta times the per-token log-prob
        assert (float(chosen), float(rejected)) == pytest.approx((2.0 * -0.5, 2.0 * -0.5))
    else:  # DPO's implicit rewards beta * (logp - ref)
        assert (float(chosen), float(rejected)) == pytest.approx((0.1 * 0.5, 0.1 * -0.5))


def test_simpo_reads_no_reference_and_the_others_need_one():
    free = L.Pairs(PAIR.logp_chosen, PAIR.logp_rejected, None, None, PAIR.len_chosen, PAIR.len_rejected)
    L.simpo(free, DPOArgs(loss="simpo"))
    with pytest.raises(ValueError, match="reference model's log-probs"):
        L.sigmoid(free, DPOArgs())
    assert DPOArgs(loss="simpo").train_inputs() == {"pair"}
    assert DPOArgs().train_inputs() == {"pair", REF_LOGPROBS}


# --------------------------------------------------------------------------- micro-batches


def policy_and_reference(char_tok, optimizer: OptimizerConfig) -> tuple[Model, Model]:
    """A tiny policy on the hf backend and a frozen copy of it (the reference)."""
    module = tiny_module(char_tok, seed=1)
    backend = HFBackend(HFBackendArgs(device="cpu", optimizer=optimizer))
    policy = backend.initialize(Model("actor", module, char_tok), FinetuneSpec(1, 8, 8, 10))
    ref = HFBackend(HFBackendArgs(device="cpu")).initialize(
        Model("ref", copy.deepcopy(module), char_tok), FinetuneSpec(1, 8, 8, 10)
    )
    return policy, ref


def pairs_batch(char_tok, tmp_path, n: int):
    """n toy pairs with the reference's log-probs, as the dataflow hands them to the dpo call."""
    ds = PreferenceDataset(PreferenceArgs(path=str(write_jsonl(tmp_path / "p.jsonl", toy_pairs()))), char_tok)
    return ds.collate(list(range(0, 4 * n, 4)))


SPLITS = [MicroBatchSpec(n_mbs=2), MicroBatchSpec(n_mbs=100), MicroBatchSpec(max_tokens_per_mb=20)]


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])  # with a reference; length-normalized, without
def test_the_split_into_micro_batches_changes_neither_loss_nor_gradients(char_tok, tmp_path, loss):
    """One SGD step on 5 pairs in 1 micro-batch, in 2, in one per pair, under a token budget: the same
    loss, metrics and weights after (so the same gradients)."""
    policy, ref = policy_and_reference(char_tok, OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=None))
    start = {k: v.clone() for k, v in policy.module.module.state_dict().items()}
    iface = DPOInterface(DPOArgs(loss=loss, beta=0.5))
    batch = pairs_batch(char_tok, tmp_path, 5)
    logp = iface.inference(ref, batch, MicroBatchSpec()).data["packed_logprobs"]
    batch.data[REF_LOGPROBS], batch.seqlens[REF_LOGPROBS] = logp, batch.seqlens["packed_input_ids"]
    results = []
    for spec in (MicroBatchSpec(), *SPLITS):
        policy.module.module.load_state_dict(start)  # SGD keeps no state: the same step from the same start
        stats = iface.train_step(policy, batch, spec)
        results.append((spec, stats, {k: v.clone() for k, v in policy.module.module.state_dict().items()}))
    (_, first, w0), *rest = results
    assert first["n_mbs"] == 1 and first["loss_weight"] == 5  # five pairs
    assert any(not torch.equal(w0[k], start[k]) for k in start)
    for spec, stats, weights in rest:
        assert stats["n_mbs"] > 1, spec
        for k in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert stats[k] == pytest.approx(first[k], rel=1e-6, abs=1e-6), (spec, k)
        for k in w0:
            torch.testing.assert_close(weights[k], w0[k], atol=1e-6, rtol=0, msg=f"{spec} {k}")
    assert num_pairs(batch) == 5


# --------------------------------------------------------------------------- training end to end


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_dpo_learns_the_preferences_and_leaves_the_reference(ws, cli):
    eval_pairs = {"type_": "preference", "args": {"path": "pairs_test.jsonl"}, "batch_size": 11}
    recipe = ws.dpo(
        eval_dataset=eval_pairs,
        trainer={"total_train_epochs": 4, "eval_every_n_steps": 20, "eval_at_start": True},
    )
    trainer = Trainer(validate(load_recipe_source(recipe)), recipe.parent, ws.root / "run")
    trainer.setup()
    actor, ref = trainer.models["actor"].module.module, trainer.models["ref"].module.module
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    ref_before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    try:
        trainer.train()
    finally:
        trainer.close()
    assert all(not torch.equal(p.detach(), before[n]) for n, p in actor.named_parameters()), (
        "a weight did not move"
    )
    assert all(torch.equal(p.detach(), ref_before[n]) for n, p in ref.named_parameters())
    rows = metrics(ws.root / "run")
    losses = [r["dpo/loss"] for r in rows if "dpo/loss" in r]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < 0.5 * math.log(2), losses
    assert {"dpo/rewards/chosen", "dpo/rewards/margins", "dpo/logps/chosen", "dpo/logps/rejected"} <= set(
        rows[-1]
    )
    evals = [r for r in rows if "eval/rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [0, 20]
    assert evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy is the reference
    assert evals[0]["eval/rewards/accuracies"] == 0.0 and evals[-1]["eval/rewards/accuracies"] == 1.0
    assert evals[-1]["eval/rewards/margins"] > 0


def test_simpo_trains_without_a_reference(ws, cli):
    recipe = ws.dpo(
        dpo_args={"loss": "simpo", "beta": 2.0}, reference=False, trainer={"total_train_epochs": 2}
    )
    train_ok = cli("train", recipe, "-o", ws.root / "run")
    assert train_ok.exit_code == 0, train_ok.output
    losses = [r["dpo/loss"] for r in metrics(ws.root / "run")]
    assert len(losses) == 10 and losses[-1] < losses[0]


# --------------------------------------------------------------------------- areal check and list


def check_errors(cli, recipe, *overrides) -> str:
    result = cli("check", recipe, *overrides)
    assert result.exit_code == 2, result.output
    return " ".join(result.stderr.split())


def test_check_says_what_a_dpo_recipe_is_missing(ws, cli):
    recipe = ws.dpo()
    assert cli("check", recipe).exit_code == 0
    err = check_errors(cli, recipe, "dataflow.calls.1.inputs=[packed_input_ids, loss_mask]")
    assert (
        "interface 'dpo' trains on packed_ref_logprobs: add them to the inputs, made by an inference call"
        in err
    )
    assert (
        "interface 'dpo' trains on pair: add them to the inputs, given by a dataset of preference pairs"
        in err
    )
    err = check_errors(cli, recipe, "dataflow.calls.1.interface.args.loss=sigmod")
    assert "unknown preference loss 'sigmod'; did you mean 'sigmoid'?" in err
    err = check_errors(cli, recipe, "dataflow.calls.1.interface.args.simpo_gamma=1.0")
    assert "loss sigmoid does not use simpo_gamma" in err
    err = check_errors(cli, recipe, "dataflow.calls.1.interface.args={loss: hinge, label_smoothing: 0.1}")
    assert "loss hinge does not use label_smoothing" in err


def test_check_keeps_pairs_and_prompts_apart(ws, cli):
    dpo = ws.dpo()
    err = check_errors(cli, dpo, "dataset={type_: prompt_answer, args: {path: train.jsonl}, batch_size: 8}")
    assert "interface 'dpo' learns from preference pairs, and the dataset (prompt_answer) has none" in err
    sft = ws.recipe(dataset={"type_": "preference", "args": {"path": "pairs.jsonl"}})
    err = check_errors(cli, sft)
    assert "the dataset (preference) holds preference pairs, which interface 'sft' does not learn from" in err
    err = check_errors(
        cli,
        dpo,
        "eval_dataset={type_: prompt_answer, args: {path: test.jsonl}, batch_size: 4}",
        "trainer.eval_every_n_steps=2",
    )
    assert "and the eval_dataset (prompt_answer) has none" in err


def test_check_names_a_missing_sft_checkpoint(ws, cli):
    recipe = ws.dpo(models={"actor": {"config": None, "path": "runs/sft/checkpoints/step_00000280/default"}})
    result = cli("check", recipe)
    assert result.exit_code == 0  # a warning: it may exist where the recipe runs
    assert "runs/sft/checkpoints/step_00000280/default does not exist" in result.stderr
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "does not exist" in result.stderr and "a checkpoint of the run" in result.stderr


def test_list_shows_the_interface_its_losses_and_the_dataset(cli):
    payload = json.loads(cli("list", "--json").stdout)
    dpo = {e["name"]: e for e in payload["interfaces"]}["dpo"]
    assert dpo["call_types"] == ["inference", "train_step"]
    assert [a["name"] for a in dpo["args"]] == ["loss", "beta", "label_smoothing", "simpo_gamma", "lr_scale"]
    assert all(a["description"] for a in dpo["args"])
    losses = {e["name"] for e in payload["preference_losses"]}
    assert losses == {"sigmoid", "ipo", "hinge", "robust", "simpo"}
    assert "pair" in {e["name"]: e for e in payload["datasets"]}["preference"]["keys"]
    plain = cli("list", "preference_losses", "--plain").stdout
    assert "# simpo (preference_loss, builtin): SimPO" in plain and "picked by: loss (dpo)" in plain
