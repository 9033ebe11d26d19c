"""Reward models: the Bradley-Terry math by hand, training on pairs, the Hugging Face round trip, a
trained reward model as the reward of RL (scores shaped by the returns call), and what `areal check`
says of reward-model recipes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from arealcli.runtime.algo import bradley_terry as bt
from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.data.preferences import PreferenceDataset
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.reward_model import ModelRewardInterface, RewardModelInterface, score
from arealcli.runtime.models.model import FinetuneSpec, Model, build_module
from arealcli.runtime.models.value_head import with_value_head
from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.datasets import PreferenceArgs
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import ModelRewardArgs, RewardModelArgs
from arealcli.schema.recipe import ModelSpec
from tests.conftest import TINY_ARCH, tiny_module, toy_rows, with_returns, write_jsonl

# max(a,b,c)= with the right answer chosen and a near miss rejected (as data/arith-pairs)
ROWS = [
    {"prompt": "max(12,45,33)=", "chosen": "45", "rejected": "33"},
    {"prompt": "max(71,22,90)=", "chosen": "90", "rejected": "91"},
    {"prompt": "max(15,16,17)=", "chosen": "17", "rejected": "71"},
    {"prompt": "max(40,30,20)=", "chosen": "40", "rejected": "4"},
    {"prompt": "max(58,85,11)=", "chosen": "85", "rejected": "58"},
    {"prompt": "max(63,36,64)=", "chosen": "64", "rejected": "644"},
]


def rm_model(tok, module=None, lr=1e-2) -> Model:
    """A tiny value-head model on the hf backend (with an optimizer when `lr`)."""
    module = module if module is not None else with_value_head(tiny_module(tok, seed=1), seed=0)
    optimizer = {"lr": lr, "gradient_clipping": None} if lr else None
    return HFBackend(HFBackendArgs(device="cpu", optimizer=optimizer)).initialize(
        Model("rm", module, tok), FinetuneSpec(1, 8, 8, 100)
    )


def pairs(tok, tmp_path: Path, rows=ROWS, **args) -> SequenceSample:
    data = PreferenceDataset(PreferenceArgs(path=str(write_jsonl(tmp_path / "p.jsonl", rows)), **args), tok)
    return data.collate(list(range(len(data))))


# --------------------------------------------------------------------------- the math, by hand


def test_bradley_terry_loss_and_metrics_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    # -log sigma(1 - 0 - 0.5) = log(1 + e^-0.5); -log sigma(0 - 2 - 0) = log(1 + e^2)
    loss = bt.bradley_terry_loss(chosen, rejected, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(loss, torch.tensor([0.474077, 2.126928]), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        bt.bradley_terry_loss(chosen, rejected)[0], torch.tensor(math.log1p(math.exp(-1)))
    )
    torch.testing.assert_close(
        bt.centering_penalty(chosen, rejected), torch.tensor([1.0, 4.0])
    )  # (s_w + s_l)^2
    m = bt.pair_metrics(chosen, rejected)
    assert float(m["accuracy"]) == 0.5 and float(m["rewards/margins"]) == -0.5
    assert float(m["rewards/chosen"]) == 0.5 and float(m["rewards/rejected"]) == 1.0


def test_the_scored_token_is_the_last_one_that_is_not_the_pad_token():
    # three packed sequences: [5 6 1], [7 0 0] (trailing pads), [0 0] (pads only)
    ids = torch.tensor([5, 6, 1, 7, 0, 0, 0, 0])
    cu = torch.tensor([0, 3, 6, 8])
    assert bt.score_positions(ids, cu, pad_id=0).tolist() == [2, 3, 6]  # HF: the rightmost non-pad, else 0
    assert bt.score_positions(ids, cu, pad_id=None).tolist() == [2, 5, 7]  # no pad token: the last


# --------------------------------------------------------------------------- training on pairs


def test_a_reward_model_learns_its_pairs_and_every_parameter_moves(char_tok, tmp_path):
    model, batch = rm_model(char_tok), pairs(char_tok, tmp_path)
    before = {k: v.clone() for k, v in model.module.module.state_dict().items()}
    rm = RewardModelInterface(RewardModelArgs())
    first = rm.train_step(model, batch, MicroBatchSpec())
    for _ in range(30):
        last = rm.train_step(model, batch, MicroBatchSpec(n_mbs=2))
    assert last["loss"] < 0.2 * first["loss"] and last["accuracy"] == 1.0, (first, last)
    assert last["rewards/margins"] > 2.0 and last["loss_weight"] == len(ROWS)  # the weight: pairs
    assert model.version.global_step == 31
    after = model.module.module.state_dict()
    assert all(not torch.equal(after[k], before[k]) for k in before)
    loader = [pairs(char_tok, tmp_path)]
    assert rm.evaluate(model, loader)["pairwise_accuracy"] == 1.0


def test_the_step_does_not_depend_on_the_micro_batch_split(char_tok, tmp_path):
    """The pairs stay together in every split, and the loss is the mean over all pairs."""
    batch = pairs(char_tok, tmp_path, margin_key="m", rows=[{**r, "m": i / 4} for i, r in enumerate(ROWS)])
    rm = RewardModelInterface(RewardModelArgs(center_rewards_coefficient=0.1))
    out = []
    for mb_spec in (MicroBatchSpec(), MicroBatchSpec(n_mbs=3), MicroBatchSpec(max_tokens_per_mb=40)):
        model = rm_model(char_tok)
        stats = rm.train_step(model, batch, mb_spec)
        out.append((stats, {k: v.clone() for k, v in model.module.module.state_dict().items()}))
    for stats, weights in out[1:]:
        assert stats["loss"] == pytest.approx(out[0][0]["loss"], abs=1e-6)
        assert stats["n_mbs"] > 1
        for k in weights:
            torch.testing.assert_close(weights[k], out[0][1][k], atol=1e-5, rtol=0)


def test_the_margin_enters_the_loss(char_tok, tmp_path):
    rows = [{**r, "m": 2.0} for r in ROWS]
    plain, margined = pairs(char_tok, tmp_path), pairs(char_tok, tmp_path, rows=rows, margin_key="m")
    assert margined.meta["margin"] == [2.0] * 2 * len(ROWS) and plain.meta["margin"] == [0.0] * 2 * len(ROWS)
    rm = RewardModelInterface(RewardModelArgs())
    s = score(rm_model(char_tok), plain, MicroBatchSpec())
    diff = s[0::2] - s[1::2]  # s_w - s_l
    expected = {m: float(-torch.nn.functional.logsigmoid(diff - m).mean()) for m in (0.0, 2.0)}
    for batch, m in ((plain, 0.0), (margined, 2.0)):
        stats = rm.train_step(rm_model(char_tok), batch, MicroBatchSpec())
        assert stats["loss"] == pytest.approx(expected[m], abs=1e-5)


def test_a_bad_margin_is_named_with_its_line(char_tok, tmp_path):
    from arealcli.errors import DataError

    rows = [{**ROWS[0], "m": 1}, {**ROWS[1], "m": "big"}, dict(ROWS[2])]
    with pytest.raises(DataError) as e:
        pairs(char_tok, tmp_path, rows=rows, margin_key="m")
    text = str(e.value)
    assert "p.jsonl:2" in text and "'m' (margin_key) must be a finite number, got str" in text
    assert "p.jsonl:3" in text and "no 'm' field" in text


# --------------------------------------------------------------------------- saved as HF's classifier


def padded(tok, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    return ids, (ids != tok.pad_token_id).long()


def test_a_saved_reward_model_scores_the_same_in_transformers_and_when_loaded_back(char_tok, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model, batch = rm_model(char_tok), pairs(char_tok, tmp_path)
    rm = RewardModelInterface(RewardModelArgs())
    for _ in range(3):
        rm.train_step(model, batch, MicroBatchSpec())
    ours = score(model, batch, MicroBatchSpec())  # (B,)
    rm.save(model, str(tmp_path / "rm"))
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["pad_token_id"] == char_tok.pad_token_id

    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", num_labels=1).eval()
    assert hf.num_labels == 1 and type(hf).__name__ == "Qwen2ForSequenceClassification"
    ids, mask = padded(char_tok, batch.unpack("packed_input_ids"))  # right-padded, lengths differ
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert ours.std() > 0.1  # not a constant: the comparison can tell sequences apart

    # and a recipe's `path:` to it (value_head: true) brings back the trained head, not a fresh one
    spec = ModelSpec.model_validate(
        {"path": str(tmp_path / "rm"), "value_head": True, "backend": {"type_": "hf"}}
    )
    reloaded = rm_model(char_tok, build_module(spec, char_tok, seed=123), lr=None)
    torch.testing.assert_close(score(reloaded, batch, MicroBatchSpec()), ours, atol=1e-6, rtol=0)


def test_a_critic_checkpoint_with_the_old_head_name_still_loads(char_tok, tmp_path):
    from arealcli.runtime.models.weights import load_state

    critic = with_value_head(tiny_module(char_tok, seed=1), seed=0)
    old = {("value_head.weight" if k == "score.weight" else k): v for k, v in critic.state_dict().items()}
    fresh = with_value_head(tiny_module(char_tok, seed=2), seed=5)
    load_state(fresh, old, "checkpoint")
    assert torch.equal(fresh.score.weight, critic.score.weight)


# --------------------------------------------------------------------------- the reward of RL


def samples(tok, texts: list[str], prompt_len: int) -> SequenceSample:
    """Generated-like samples (prompt + response), two per prompt, as the actor's generate call gives."""
    ids = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in texts]
    return SequenceSample.from_lists(
        [(i // 2, i % 2) for i in range(len(texts))],
        {
            "packed_input_ids": ids,
            "prompt_mask": [torch.arange(len(x)) < prompt_len for x in ids],
            "packed_logprobs": [torch.zeros(len(x)) for x in ids],
        },
    )


def test_rm_reward_scores_samples_and_the_returns_call_shapes_them(char_tok, tmp_path):
    model, batch = rm_model(char_tok), pairs(char_tok, tmp_path)
    trainer = RewardModelInterface(RewardModelArgs())
    for _ in range(20):
        trainer.train_step(model, batch, MicroBatchSpec())
    frozen = rm_model(char_tok, model.module.module, lr=None)  # the trained weights, no optimizer
    texts = ["max(12,45,33)=45", "max(12,45,33)=33", "max(71,22,90)=90", "max(71,22,90)=91"]
    data = samples(char_tok, texts, prompt_len=len("max(12,45,33)="))
    out = ModelRewardInterface(ModelRewardArgs()).inference(frozen, data, MicroBatchSpec(n_mbs=2))
    rewards = out.data["rewards"]
    assert rewards.shape == (4,) and out.seqlens["rewards"] == [1] * 4
    assert rewards[0] > rewards[1] and rewards[2] > rewards[3]  # the right answers score higher
    # the same score as the pairs' own (the scored token: the EOS after the answer)
    torch.testing.assert_close(rewards[0], score(frozen, batch, MicroBatchSpec())[0], atol=1e-6, rtol=0)

    data.update_(out)
    data.data["seq_no_eos_mask"] = torch.zeros(4)
    data.seqlens["seq_no_eos_mask"] = [1] * 4
    bias, scale = 0.5, 2.0
    size = ((rewards - bias) * scale).abs().sort().values
    clip = float(size[1] + size[2]) / 2  # two scores beyond the clip, two within
    shaped = with_returns(
        data, shaping={"reward_bias": bias, "reward_scaling": scale, "max_reward_clip": clip}
    )
    expected = ((rewards - bias) * scale).clamp(-clip, clip)  # the rule rewards' shaping, unchanged
    torch.testing.assert_close(shaped.data["seq_scores"], expected)
    assert (expected.abs() == clip).any() and (expected.abs() < clip).any()  # both branches exercised

    # a truncated answer (no EOS) is text the reward model never saw: no_eos_score replaces its score
    # before the shaping; the others keep theirs
    data.data["seq_no_eos_mask"] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    shaping = {"reward_bias": bias, "reward_scaling": scale, "max_reward_clip": 100.0, "no_eos_score": -3.0}
    shaped = with_returns(data, shaping=shaping)
    no_eos = torch.tensor([False, True, False, True])
    expected = (torch.where(no_eos, torch.tensor(-3.0), rewards) - bias) * scale
    torch.testing.assert_close(shaped.data["seq_scores"], expected)


def test_no_eos_score_and_mask_no_eos_with_zero_are_one_setting():
    from pydantic import ValidationError

    from arealcli.schema.components.interfaces import RewardShaping

    assert RewardShaping().no_eos_value() is None
    assert RewardShaping(mask_no_eos_with_zero=True).no_eos_value() == 0.0
    assert RewardShaping(no_eos_score=-20).no_eos_value() == -20.0
    with pytest.raises(ValidationError, match="set one of them"):
        RewardShaping(mask_no_eos_with_zero=True, no_eos_score=-20)


# --------------------------------------------------------------------------- recipes and `areal check`

RM_ARCH = {"config": TINY_ARCH, "value_head": True, "backend": {"type_": "hf", "args": {"device": "cpu"}}}


def from_path(path) -> dict:
    """The reward model loaded from a folder (a checkpoint or an export)."""
    return {"path": str(path), "value_head": True, "backend": RM_ARCH["backend"]}


def rlhf_recipe(ws, reward_model: dict, name="rlhf.yaml") -> Path:
    """The grpo preset with a reward model's scores as the reward."""
    import yaml

    recipe = {
        "experiment": "tiny-rlhf",
        "seed": 1,
        "tokenizer": {"kind": "char"},
        "models": {
            "actor": {
                "config": TINY_ARCH,
                "backend": {"type_": "hf", "args": {"device": "cpu", "optimizer": {"lr": 1e-3}}},
            },
            "reward_model": reward_model,
        },
        "dataset": {"type_": "prompt_answer", "args": {"path": "train.jsonl"}, "batch_size": 4},
        "dataflow": {
            "preset": "grpo",
            "actor": {"generation": {"n": 2, "max_new_tokens": 4}},
            "reward": {"model": "reward_model"},
        },
        "trainer": {"max_steps": 2, "tensorboard": False},
    }
    return ws.text(name, yaml.safe_dump(recipe, sort_keys=False))


def test_the_grpo_preset_takes_a_reward_model_as_its_reward(ws, cli, tmp_path, char_tok):
    saved = tmp_path / "rm"
    model = rm_model(char_tok)
    RewardModelInterface(RewardModelArgs()).save(model, str(saved))
    recipe = rlhf_recipe(ws, from_path(saved))
    result = cli("check", recipe, "--print")
    assert result.exit_code == 0, result.output
    import yaml

    calls = {c["name"]: c for c in yaml.safe_load(result.stdout)["dataflow"]["calls"]}
    assert calls["reward"]["model"] == "reward_model" and calls["reward"]["interface"]["type_"] == "rm_reward"
    assert "answers" not in calls["reward"]["inputs"]
    assert calls["actor_train"]["interface"]["args"]["eval_reward_fn"] is None  # held out: math, not the RM


def test_check_says_what_is_wrong_with_a_reward_model(ws, cli, tmp_path, char_tok):
    # built from a config: its head would be random
    result = cli("check", rlhf_recipe(ws, RM_ARCH))
    assert result.exit_code == 2
    assert (
        "models.reward_model: model 'reward_model' scores responses in call 'reward' (rm_reward)"
        in result.stderr
    )
    assert "built from `config`" in result.stderr and "give `path:`" in result.stderr
    # no value head
    no_head = {k: v for k, v in RM_ARCH.items() if k != "value_head"}
    result = cli("check", rlhf_recipe(ws, no_head))
    assert result.exit_code == 2 and "add `value_head: true`" in result.stderr
    # a language model's folder is not a reward model
    tiny_module(char_tok).save_pretrained(tmp_path / "lm")
    result = cli("check", rlhf_recipe(ws, from_path(tmp_path / "lm")))
    assert result.exit_code == 2
    assert "is not a reward model (its config.json names ['Qwen2ForCausalLM']" in result.stderr


def test_a_missing_reward_model_checkpoint_names_the_recipe_that_trains_it(ws, cli, monkeypatch):
    monkeypatch.chdir(ws.root)
    ws.text("rm.yaml", "# trains the reward model\nexperiment: my-rm\n")
    path = "runs/my-rm/checkpoints/step_00000010/reward_model"
    recipe = rlhf_recipe(ws, from_path(path))
    check = cli("check", recipe)
    assert check.exit_code == 0, check.output  # a warning: it may exist where the recipe will run
    assert "a checkpoint of the run" in check.stderr and "run `areal train rm.yaml` first" in check.stderr
    train = cli("train", recipe, "-o", ws.root / "run")
    assert train.exit_code == 2 and "run `areal train rm.yaml` first" in train.stderr
    assert "Traceback" not in train.output


def reward_model_recipe(ws, backend: str = "hf", **update) -> Path:
    """A Bradley-Terry reward model (value head) trained on pairs made from the toy rows: the next four
    letters chosen, the same letters reversed rejected (held out: every fourth pair)."""
    rows = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"][::-1]} for r in toy_rows()]
    write_jsonl(ws.root / "pairs.jsonl", rows)
    write_jsonl(ws.root / "test-pairs.jsonl", rows[::4])
    call = {
        "name": "reward_train",
        "model": "default",
        "interface": {"type_": "reward_model"},
        "type": "train_step",
        "inputs": ["packed_input_ids", "prompt_mask", "pair", "margin"],
        "mb_spec": {"n_mbs": 2},
    }
    return ws.recipe(
        models={"default": {"value_head": True, "backend": {"type_": backend}}},
        dataset={"type_": "preference", "args": {"path": "pairs.jsonl"}},
        eval_dataset={"type_": "preference", "args": {"path": "test-pairs.jsonl"}, "batch_size": 6},
        dataflow={"calls": [call]},
        **update,
    )


@pytest.mark.slow
def test_a_reward_model_trains_on_fsdp_over_two_processes_as_in_one(ws, cli):
    """4 steps (global batch 8 pairs, shuffled, 2 micro-batches per rank): fsdp over 2 processes gives
    the losses, held-out pairwise accuracy and weights of hf in one process (19 s here)."""
    from test_distributed import areal, ok

    trainer = {"max_steps": 4, "eval_every_n_steps": 2, "save_every_n_steps": 4, "tensorboard": False}
    one, two = ws.root / "one", ws.root / "two"
    result = cli("train", reward_model_recipe(ws, "hf", name="hf.yaml", trainer=trainer), "-o", one)
    assert result.exit_code == 0, result.output
    ok(
        areal(
            "train",
            reward_model_recipe(ws, "fsdp", name="fsdp.yaml", trainer=trainer),
            "-o",
            two,
            "--nproc-per-node",
            2,
            cwd=ws.root,
        )
    )

    def rows(run: Path) -> dict[int, dict]:
        return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    a, b = rows(one), rows(two)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step]["reward_train/loss"] == pytest.approx(a[step]["reward_train/loss"], abs=1e-4), step
        assert b[step]["reward_train/accuracy"] == pytest.approx(a[step]["reward_train/accuracy"], abs=1e-6)
    assert b[4]["eval/pairwise_accuracy"] == a[4]["eval/pairwise_accuracy"]
    assert b[4]["eval/pairwise_margin"] == pytest.approx(a[4]["eval/pairwise_margin"], abs=1e-4)
    assert a[4]["eval/pairwise_margin"] != a[2]["eval/pairwise_margin"]  # it trained
    from safetensors.torch import load_file

    w1, w2 = (load_file(str(r / "checkpoints/step_00000004/default/model.safetensors")) for r in (one, two))
    assert w1.keys() == w2.keys() and "score.weight" in w1
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-4, rtol=0, msg=k)


# --------------------------------------------------------------------------- areal eval


def test_areal_eval_gives_a_reward_models_pairwise_accuracy(ws, cli):
    """On a run: its eval_dataset's pairs, the run's own final held-out score exactly; on a folder with
    --data: the same pairs give the same score. A chat with a reward model is refused."""
    trainer = {"max_steps": 6, "eval_every_n_steps": 6, "tensorboard": False}
    run = ws.root / "run"
    result = cli("train", reward_model_recipe(ws, trainer=trainer), "-o", run)
    assert result.exit_code == 0, result.output
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]

    out = ws.root / "results.json"
    result = cli("eval", run, "-o", out)
    assert result.exit_code == 0, result.output
    assert "11 pairs" in result.stdout and "pairwise_accuracy" in result.stdout
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["pairwise_accuracy"] == pytest.approx(final["eval/pairwise_accuracy"], abs=1e-9)
    assert metrics["pairwise_margin"] == pytest.approx(final["eval/pairwise_margin"], abs=1e-5)
    lo, hi = metrics["pairwise_accuracy_ci95"]
    assert lo <= metrics["pairwise_accuracy"] <= hi
    sample = json.loads(out.with_name("results.samples.jsonl").read_text().splitlines()[0])
    assert sample["chosen"] == "bcde" and sample["rejected"] == "edcb" and "chosen_score" in sample

    folder = run / "checkpoints" / "step_00000006" / "default"
    again = cli("eval", folder, "--data", ws.root / "test-pairs.jsonl", "-o", ws.root / "again.json")
    assert again.exit_code == 0, again.output
    assert json.loads((ws.root / "again.json").read_text())["metrics"] == metrics

    wrong = cli("eval", folder, "--data", ws.root / "test.jsonl")  # prompts with answers, not pairs
    assert wrong.exit_code == 2 and "test.jsonl:1" in wrong.stderr and "'chosen'" in wrong.stderr
    chat = cli("chat", run)
    assert chat.exit_code == 2 and "reward model" in chat.stderr and "areal eval" in chat.stderr
