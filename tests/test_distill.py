"""On-policy distillation (`preset: distill`): the calls it expands to, the returns it computes (each
token's reward is -(log student - log teacher), not discounted), what `areal check` and `areal train`
refuse, and a short run in which the student moves toward its teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.returns import ReturnsInterface
from arealcli.schema.components.interfaces import ReturnsArgs
from tests.conftest import TINY_ARCH, sft_recipe

HF = {"type_": "hf", "args": {"device": "cpu"}}


def distill_recipe(ws, teacher_model: dict | None, name: str = "distill.yaml", **dataflow) -> Path:
    models = {
        "actor": {
            "config": TINY_ARCH,
            "backend": {**HF, "args": {"device": "cpu", "optimizer": {"lr": 1e-3}}},
        }
    }
    if teacher_model is not None:
        models["teacher"] = teacher_model
    recipe = {
        "experiment": "tiny-distill",
        "seed": 1,
        "tokenizer": {"kind": "char"},
        "models": models,
        "dataset": {"type_": "prompt_answer", "args": {"path": "train.jsonl"}, "batch_size": 4},
        "dataflow": {
            "preset": "distill",
            "actor": {"generation": {"n": 2, "max_new_tokens": 4}, "n_minibatches": 1},
            **dataflow,
        },
        "trainer": {"max_steps": 2, "tensorboard": False},
    }
    return ws.text(name, yaml.safe_dump(recipe, sort_keys=False))


def test_the_distill_preset_scores_with_the_teacher_and_no_reward(ws, cli):
    result = cli("check", distill_recipe(ws, {"config": TINY_ARCH, "backend": HF}), "--print")
    assert result.exit_code == 0, result.output
    calls = {c["name"]: c for c in yaml.safe_load(result.stdout)["dataflow"]["calls"]}
    assert list(calls) == ["actor_gen", "teacher_logprobs", "returns", "actor_train"]
    assert calls["teacher_logprobs"]["model"] == "teacher"
    assert calls["teacher_logprobs"]["outputs"] == ["packed_ref_logprobs"]
    shaping = calls["returns"]["interface"]["args"]["shaping"]
    assert (shaping["kl_ctl"], shaping["kl_in_reward"], shaping["discount"]) == (1.0, True, 0.0)
    assert "rewards" not in calls["returns"]["inputs"] and "rewards" not in calls["actor_train"]["inputs"]
    assert calls["actor_train"]["interface"]["args"]["adv_norm"] == "batch"

    # a task reward mixed in: the rule reward's call, its scores added to the KL rewards
    mixed = distill_recipe(
        ws, {"config": TINY_ARCH, "backend": HF}, "mixed.yaml", reward={"reward_fn": "math"}
    )
    result = cli("check", mixed, "--print")
    assert result.exit_code == 0, result.output
    calls = {c["name"]: c for c in yaml.safe_load(result.stdout)["dataflow"]["calls"]}
    assert list(calls) == ["actor_gen", "reward", "teacher_logprobs", "returns", "actor_train"]
    assert "rewards" in calls["returns"]["inputs"]


def test_check_refuses_a_distillation_without_its_teacher_or_with_a_reference(ws, cli):
    result = cli("check", distill_recipe(ws, None))
    assert result.exit_code == 2
    assert "the distill preset needs a model named `teacher`" in result.stderr
    teacher = {"config": TINY_ARCH, "backend": HF}
    recipe = yaml.safe_load(distill_recipe(ws, teacher).read_text())
    recipe["models"]["ref"] = {"init_from": "actor"}
    recipe["dataflow"]["actor"]["dynamic_sampling"] = True
    result = cli("check", ws.text("ref.yaml", yaml.safe_dump(recipe)))
    assert result.exit_code == 2
    assert "the distill preset takes no `ref`" in result.stderr
    assert "distill has no reward unless `reward:` gives one" in result.stderr


def test_each_tokens_advantage_is_its_own_reverse_kl_to_the_teacher():
    """Two sequences, prompt of 2 tokens then 3 response tokens: with the distill shaping the returns
    call's advantages are -(logp - teacher logp) at each action, nothing carried from later tokens."""
    ids = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 8, 9])
    logp = torch.tensor([0.0, -1.0, -2.0, -0.5, 0.0, 0.0, -0.1, -0.2, -0.3, 0.0])
    teacher = torch.tensor([0.0, -0.5, -1.0, -1.5, 0.0, 0.0, -0.1, -0.4, -0.1, 0.0])
    data = SequenceSample(
        [0, 1],
        {
            "packed_input_ids": [5, 5],
            "prompt_mask": [5, 5],
            "packed_logprobs": [5, 5],
            "packed_ref_logprobs": [5, 5],
            "seq_no_eos_mask": [1, 1],
        },
        {
            "packed_input_ids": ids,
            "prompt_mask": torch.tensor([1, 1, 0, 0, 0] * 2, dtype=torch.bool),
            "packed_logprobs": logp,
            "packed_ref_logprobs": teacher,
            "seq_no_eos_mask": torch.tensor([0.0, 0.0]),
        },
    )
    args = ReturnsArgs(shaping={"kl_ctl": 1.0, "kl_in_reward": True, "discount": 0.0})
    out = ReturnsInterface(args).advantages_and_returns(data)
    adv = out.data["advantages"]
    # action positions 1..3 of each sequence (the prompt's last token predicts the first response token)
    expected = -(logp - teacher)
    for start in (0, 5):
        torch.testing.assert_close(adv[start + 1 : start + 4], expected[start + 1 : start + 4])
    assert out.stats["kl_ref"] == pytest.approx(float((logp - teacher)[[1, 2, 3, 6, 7, 8]].mean()), abs=1e-6)


# 40 SFT steps, then 40 distillation steps, on the toy task
WARM_THEN_DISTILL = [
    "trainer.max_steps=80",
    "trainer.log_every_n_steps=1",
    "dataflow.sft_warmup_steps=40",
    "models.actor.backend.args.optimizer.lr=0.01",
    "dataflow.actor.lr_scale=0.3",
    "dataflow.actor.generation.n=4",
    "dataset.batch_size=8",
]


def teacher_folder(tmp_path: Path, ws, cli) -> Path:
    """A teacher: a tiny model trained by SFT on the toy task (the student starts untrained)."""
    recipe = ws.text(
        "teacher.yaml",
        yaml.safe_dump(
            sft_recipe(trainer={"max_steps": 60, "save_every_n_steps": 60, "tensorboard": False}),
            sort_keys=False,
        ),
    )
    result = cli("train", recipe, "-o", tmp_path / "teacher")
    assert result.exit_code == 0, result.output
    return tmp_path / "teacher" / "checkpoints" / "step_00000060" / "default"


def test_the_student_moves_toward_its_teacher(ws, cli, tmp_path):
    """A student after a short SFT warm-up (40 steps), then 40 distillation steps: the per-token KL to
    the teacher falls by 40% or more (by 60% here) and the teacher's log-probs of the student's samples rise; no reward is
    computed or logged."""
    teacher = teacher_folder(tmp_path, ws, cli)
    recipe = distill_recipe(ws, {"path": str(teacher), "backend": HF})
    run = tmp_path / "run"
    result = cli("train", recipe, "-o", run, *WARM_THEN_DISTILL)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [r["actor_train/kl_ref"] for r in rows if "actor_train/kl_ref" in r]
    teacher_logp = [r["actor_train/logp_ref"] for r in rows if "actor_train/logp_ref" in r]
    assert len(kl) == 40 and not any("reward" in k for r in rows for k in r if k.startswith("actor_train/"))
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert last < 0.6 * first, kl
    assert sum(teacher_logp[-5:]) / 5 > sum(teacher_logp[:5]) / 5 + 0.2, teacher_logp


def test_a_teacher_with_another_vocabulary_is_refused_with_exit_2(ws, cli, tmp_path):
    """Token ids are what the student and the teacher share: a teacher saved with another tokenizer
    would score the student's ids as other tokens."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import tiny_module

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz:"])}
    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    folder = tmp_path / "other-teacher"
    tiny_module(other).save_pretrained(folder)
    other.save_pretrained(folder)
    result = cli("train", distill_recipe(ws, {"path": str(folder), "backend": HF}), "-o", tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert (
        "model 'teacher': its tokenizer (30 tokens" in result.stderr and "is not the run's" in result.stderr
    )
    assert "Traceback" not in result.output


def test_a_served_teacher_gives_the_log_probs_of_the_same_teacher_in_process(ws, cli, tmp_path, model_dir):
    """The teacher as a model of the recipe (hf, in this process) and the same weights served by a keyed
    `areal serve` (`dataflow.teacher: {url: ...}`, interface remote_logprobs: prompt log-probs through
    /v1/completions with echo): the student's KL to it and its log-probs agree step by step (float
    noise of two forward passes apart); a wrong key stops the run naming the server's 401."""
    import os
    import subprocess
    import sys

    from tests.test_judge import _free_port, _wait_health

    local = distill_recipe(ws, {"path": str(model_dir), "backend": HF})
    result = cli("train", local, "-o", tmp_path / "local", "trainer.log_every_n_steps=1")
    assert result.exit_code == 0, result.output

    port, key = _free_port(), "teacher-key-0123456789abcdef"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    served = distill_recipe(
        ws, None, "served.yaml", teacher={"url": f"http://127.0.0.1:{port}", "api_key_env": "TEACHER_KEY"}
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "arealcli.main", "serve", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**env, "AREAL_API_KEY": key},
    )
    try:
        _wait_health(f"http://127.0.0.1:{port}", server)
        os.environ["TEACHER_KEY"] = key
        result = cli("train", served, "-o", tmp_path / "served", "trainer.log_every_n_steps=1")
        os.environ["TEACHER_KEY"] = "not-the-key-0123456789"
        refused = cli("train", served, "-o", tmp_path / "refused")
    finally:
        os.environ.pop("TEACHER_KEY", None)
        server.terminate()
        server.wait(10)
    assert result.exit_code == 0, result.output

    def rows(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    keys = ("actor_train/kl_ref", "actor_train/logp_ref", "actor_train/logp_policy")
    a, b = rows(tmp_path / "local"), rows(tmp_path / "served")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        for k in keys:
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-5), (k, x[k], y[k])
    assert refused.exit_code != 0 and "scoring failed at step 1: the teacher" in refused.output
    assert "401" in refused.output


def test_check_refuses_two_teachers_and_a_served_teacher_at_another_temperature(ws, cli):
    teacher = {"config": TINY_ARCH, "backend": HF}
    both = distill_recipe(ws, teacher, "both.yaml", teacher={"url": "http://127.0.0.1:9"})
    result = cli("check", both)
    assert result.exit_code == 2 and "not both" in result.stderr
    recipe = yaml.safe_load(distill_recipe(ws, None, teacher={"url": "http://127.0.0.1:9"}).read_text())
    recipe["dataflow"]["actor"]["generation"]["temperature"] = 0.7
    result = cli("check", ws.text("hot.yaml", yaml.safe_dump(recipe)))
    assert result.exit_code == 2 and "a served teacher gives its log-probs at temperature 1" in result.stderr
    result = cli("check", distill_recipe(ws, None, "bad.yaml", teacher={"url": "localhost:9"}))
    assert result.exit_code == 2 and "a teacher URL is http://HOST[:PORT]" in result.stderr


def test_topk_distillation_expands_to_the_teachers_topk_and_a_kl_loss(ws, cli):
    teacher = {"config": TINY_ARCH, "backend": HF}
    result = cli("check", distill_recipe(ws, teacher, topk=4), "--print")
    assert result.exit_code == 0, result.output
    calls = {c["name"]: c for c in yaml.safe_load(result.stdout)["dataflow"]["calls"]}
    assert list(calls) == ["actor_gen", "teacher_topk", "actor_train"]
    assert calls["teacher_topk"]["model"] == "teacher"
    assert calls["teacher_topk"]["outputs"] == ["packed_topk_ids", "packed_topk_logprobs"]
    assert calls["actor_train"]["interface"] == {**calls["actor_train"]["interface"], "type_": "distill_topk"}
    assert calls["actor_train"]["interface"]["args"]["topk"] == 4
    mixed = distill_recipe(ws, teacher, "mixed.yaml", topk=4, reward={"reward_fn": "math"})
    result = cli("check", mixed)
    assert result.exit_code == 2 and "a task reward does not enter it" in result.stderr


def test_the_topk_loss_is_the_exact_kl_when_k_is_the_vocabulary():
    """KL(q || pi) over the teacher's top k, q renormalized: with k = V it equals the full forward KL
    sum_v p_T(v) (log p_T(v) - log pi(v)), and only response-predicting positions count."""
    from arealcli.runtime.engines.lm_output import LMOutput
    from arealcli.runtime.interfaces.distill_topk import teacher_topk, topk_kl_loss
    from arealcli.schema.components.interfaces import TOPK_IDS, TOPK_LOGPROBS

    torch.manual_seed(0)
    vocab, lens = 7, [4, 3]
    student, teacher = torch.randn(sum(lens), vocab), torch.randn(sum(lens), vocab)
    prompt = torch.tensor([1, 1, 0, 0, 1, 0, 0], dtype=torch.bool)
    for k in (vocab, 3):
        values, ids = teacher_topk(LMOutput.from_logits(teacher), k)
        mb = SequenceSample(
            [0, 1],
            {"packed_input_ids": lens, "prompt_mask": lens, TOPK_IDS: lens, TOPK_LOGPROBS: lens},
            {
                "packed_input_ids": torch.zeros(sum(lens), dtype=torch.long),
                "prompt_mask": prompt,
                TOPK_IDS: ids,
                TOPK_LOGPROBS: values,
            },
        )
        loss, stats = topk_kl_loss(LMOutput.from_logits(student), mb)
        rows = [1, 2, 4, 5]  # the positions whose next token is a response token (not a sequence's last)
        log_q = torch.log_softmax(values[rows], -1)
        log_pi = torch.log_softmax(student[rows], -1).gather(-1, ids[rows])
        expected = (log_q.exp() * (log_q - log_pi)).sum(-1).mean()
        torch.testing.assert_close(loss, expected)
        if k == vocab:
            full = (
                torch.nn.functional.kl_div(
                    torch.log_softmax(student[rows], -1),
                    torch.log_softmax(teacher[rows], -1),
                    log_target=True,
                    reduction="none",
                )
                .sum(-1)
                .mean()
            )
            torch.testing.assert_close(loss, full)
            assert float(stats["teacher_mass"]) == pytest.approx(1.0)


def test_topk_distillation_moves_the_student_toward_its_teacher(ws, cli, tmp_path):
    """The same warm-up and teacher as the sampled-token test, 40 top-k distillation steps (k = 8): the
    KL over the teacher's top-k falls by half or more (0.79 -> 0.26 here, on every kernel set)."""
    teacher = teacher_folder(tmp_path, ws, cli)
    recipe = distill_recipe(ws, {"path": str(teacher), "backend": HF}, topk=8)
    run = tmp_path / "run"
    result = cli("train", recipe, "-o", run, *WARM_THEN_DISTILL)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [r["actor_train/kl_topk"] for r in rows if "actor_train/kl_topk" in r]
    assert len(kl) == 40
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    print(f"top-k KL to the teacher: {first:.3f} -> {last:.3f}")
    assert last < 0.5 * first, kl
