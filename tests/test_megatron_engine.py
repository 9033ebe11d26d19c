"""The megatron engine against the hf engine: the same SFT steps at TP=2, PP=2, DP=2 (and, slow,
TP2xDP2, TP2xPP2) give the same losses, gradient norms and weights; the export loads with
transformers; evaluation, greedy generation and a PPO actor step agree; resume is exact.

Multi-process cases run as gloo worker processes (tests/_megatron_engine_worker.py), one job per
process count, several layouts per job; the hf references run here, in the test process.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
import yaml  # noqa: E402
from _dist_helpers import gloo_world_of_one  # noqa: E402
from _megatron_engine_worker import OPTIMIZER, SFT_MB_SPEC, dp_slice, launch  # noqa: E402
from conftest import sft_recipe, tiny_module, with_returns  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from arealcli.runtime.backends.hf import HFBackend  # noqa: E402
from arealcli.runtime.data.sample import SequenceSample  # noqa: E402
from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface  # noqa: E402
from arealcli.runtime.interfaces.sft import SFTInterface, num_answer_tokens, sft_loss  # noqa: E402
from arealcli.runtime.models.model import FinetuneSpec, Model  # noqa: E402
from arealcli.schema.components.backends import HFBackendArgs, MegatronBackendArgs  # noqa: E402
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec  # noqa: E402
from arealcli.schema.components.interfaces import PPOActorArgs, SFTArgs  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
pytestmark = pytest.mark.filterwarnings("ignore:.*tp_group is None.*:DeprecationWarning")

ARCH = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, intermediate_size=128
)
N_STEPS = 3
ATOL = 1e-4
# Weights after N_STEPS Adam steps at lr 1e-2: a near-zero gradient entry turns rounding differences
# between the two paths into an update of its own; measured max 3e-5 (AVX-512), 1.2e-4 (AVX2 kernels).
WEIGHT_ATOL = 1e-3
PPO_ARGS = dict(generation={"n": 4, "max_new_tokens": 4}, adv_norm="group", n_minibatches=1)


# --------------------------------------------------------------------------- data


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def sft_batch(tok, seed: int, bs: int = 8) -> SequenceSample:
    """Prompt `word:` -> answer `reversed word` of varying length (+ EOS): samples carry different
    numbers of answer tokens, so the global token normalization over ranks matters."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(bs):
        word = "".join(
            chr(97 + int(c))
            for c in torch.randint(0, 26, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        )
        prompt, answer = encode(tok, word + ":"), encode(tok, word[::-1]) + [tok.eos_token_id]
        ids.append(torch.tensor(prompt + answer))
        masks.append(torch.arange(len(prompt) + len(answer)) < len(prompt))
    return SequenceSample.from_lists(list(range(bs)), {"packed_input_ids": ids, "prompt_mask": masks})


def prompts_batch(tok, texts: list[str]) -> SequenceSample:
    ids = [torch.tensor(encode(tok, t)) for t in texts]
    return SequenceSample.from_lists(
        list(range(len(texts))), {"packed_prompts": ids}, {"prompt": texts, "answers": [["x"]] * len(texts)}
    )


def hf_engine_model(tok, module) -> Model:
    args = HFBackendArgs(device="cpu", optimizer=OPTIMIZER)
    return HFBackend(args).initialize(Model("actor", module, tok), FinetuneSpec(1, 8, 8, N_STEPS))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, char_tok) -> Path:
    """The initial HF model, SFT batches, eval batch, prompts and a PPO rollout, on disk."""
    root = tmp_path_factory.mktemp("megatron_engine")
    module = tiny_module(char_tok, seed=0, **ARCH)
    module.save_pretrained(root / "init")
    char_tok.save_pretrained(root / "init")
    torch.save([sft_batch(char_tok, seed=s) for s in range(N_STEPS)], root / "sft_batches.pt")
    torch.save(sft_batch(char_tok, seed=100, bs=6), root / "eval_batch.pt")
    torch.save(prompts_batch(char_tok, ["abc:", "hello:", "q:", "xyzzy:", "mn:"]), root / "prompts.pt")

    iface = PPOActorInterface(PPOActorArgs(**PPO_ARGS))
    torch.manual_seed(0)
    rollout = iface.generate(
        hf_engine_model(char_tok, copy.deepcopy(module)),
        prompts_batch(char_tok, ["ab:", "cde:"]),
        MicroBatchSpec(),
    )
    rollout.data["rewards"] = torch.tensor([1.0, 0, 0, 1, 0, 1, 0, 0])
    rollout.seqlens["rewards"] = [1] * rollout.bs
    torch.save(with_returns(rollout), root / "rollout.pt")
    torch.save(PPO_ARGS, root / "ppo_args.pt")
    return root


@pytest.fixture(scope="module")
def hf_reference(workdir, char_tok) -> dict:
    """The hf engine on one process: SFT steps over whole global batches, then a PPO step."""
    model = hf_engine_model(char_tok, AutoModelForCausalLM.from_pretrained(workdir / "init"))
    sft = SFTInterface(SFTArgs())
    batches = torch.load(workdir / "sft_batches.pt", weights_only=False)
    steps = [sft.train_step(model, b, MicroBatchSpec(**SFT_MB_SPEC)) for b in batches]
    final = {k: v.clone() for k, v in model.module.module.state_dict().items()}
    iface = PPOActorInterface(PPOActorArgs(**PPO_ARGS))
    ppo = iface.train_step(
        model, torch.load(workdir / "rollout.pt", weights_only=False), MicroBatchSpec(n_mbs=2)
    )
    return {"steps": steps, "final": final, "ppo": ppo, "ppo_final": model.module.module.state_dict()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_same_training(result: dict, ref: dict) -> None:
    for got, want in zip(result["steps"], ref["steps"], strict=True):
        assert abs(got["loss"] - want["loss"]) < ATOL, (got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) < ATOL * max(1.0, want["grad_norm"])
        assert got["lr"] == want["lr"] and got["loss_weight"] == want["loss_weight"]
    assert max_diff(result["final"], ref["final"]) < WEIGHT_ATOL


# --------------------------------------------------------------------------- 2 processes

TWO_PROC = {"tp2pp1dp1": "2x1:generate+ppo", "tp1pp2dp1": "1x2:generate+resume", "tp1pp1dp2": "1x1:ppo"}


@pytest.fixture(scope="module")
def two_process_results(workdir, hf_reference) -> dict:
    launch(2, ["--workdir", str(workdir), "--layouts", ",".join(TWO_PROC.values())])
    return {name: torch.load(workdir / name / "result.pt", weights_only=False) for name in TWO_PROC}


@pytest.mark.parametrize("layout", list(TWO_PROC))
def test_sft_steps_match_hf(two_process_results, hf_reference, layout) -> None:
    assert_same_training(two_process_results[layout], hf_reference)


@pytest.mark.parametrize("layout", list(TWO_PROC))
def test_save_to_hf_loads_with_transformers(
    two_process_results, hf_reference, workdir, char_tok, layout
) -> None:
    exported = AutoModelForCausalLM.from_pretrained(workdir / layout / "hf")
    assert max_diff(exported.state_dict(), hf_reference["final"]) < WEIGHT_ATOL
    ids = torch.tensor([encode(char_tok, "hello:olleh")])
    reference = tiny_module(char_tok, **ARCH)
    reference.load_state_dict(hf_reference["final"])
    torch.testing.assert_close(exported(ids).logits, reference(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", list(TWO_PROC))
def test_eval_and_eval_batch_match_hf_on_the_exported_weights(
    two_process_results, workdir, char_tok, layout
) -> None:
    model = hf_engine_model(char_tok, AutoModelForCausalLM.from_pretrained(workdir / layout / "hf"))
    eval_batch = torch.load(workdir / "eval_batch.pt", weights_only=False)
    want = SFTInterface(SFTArgs()).evaluate(model, [eval_batch])  # the interface sums over ranks
    got = two_process_results[layout]["eval"]
    assert abs(got["nll"] - want["nll"]) < 1e-5
    # eval_batch averages over the samples of every data-parallel rank (each rank's micro-batches
    # weighted by their size): the same from the hf engine, rank slice by rank slice
    dp = int(layout[-1])
    slices = [dp_slice(eval_batch, r, dp) for r in range(dp)]
    per_slice = [model.module.eval_batch(x, MicroBatchSpec(n_mbs=2), sft_loss) for x in slices]
    want = {
        k: sum(p[k] * x.bs for p, x in zip(per_slice, slices, strict=True)) / eval_batch.bs
        for k in per_slice[0]
    }
    got = two_process_results[layout]["eval_batch"]
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-5 for k in want)


@pytest.mark.parametrize("layout", ["tp2pp1dp1", "tp1pp2dp1"])
def test_greedy_generation_matches_hf(two_process_results, workdir, char_tok, layout) -> None:
    model = hf_engine_model(char_tok, AutoModelForCausalLM.from_pretrained(workdir / layout / "hf"))
    g = GenerationHyperparameters(greedy=True, max_new_tokens=6)
    want = model.module.generate(
        torch.load(workdir / "prompts.pt", weights_only=False), MicroBatchSpec(), char_tok, g
    )
    ids, logprobs, no_eos = two_process_results[layout]["generate"]
    assert ids == want.output_ids and no_eos == want.no_eos
    for a, b in zip(logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["tp2pp1dp1", "tp1pp1dp2"])
def test_ppo_actor_step_changes_weights_like_hf(two_process_results, hf_reference, layout) -> None:
    result = two_process_results[layout]
    assert result["ppo_max_change"] > 1e-4  # the step did something ...
    assert abs(result["ppo"]["loss"] - hf_reference["ppo"]["loss"]) < ATOL  # ... and the right thing
    assert max_diff(result["ppo_final"], hf_reference["ppo_final"]) < WEIGHT_ATOL


def test_resume_is_exact_at_pp2(two_process_results) -> None:
    """Export + optimizer state after step k, a fresh engine from them, step k+1 == no interruption."""
    result = two_process_results["tp1pp2dp1"]
    assert result["resumed_step"]["loss"] == result["steps"][-1]["loss"]
    assert max_diff(result["resumed_final"], result["final"]) < 1e-6


# --------------------------------------------------------------------------- 4 processes (slow)

FOUR_PROC = {"tp2pp1dp2": "2x1:ppo", "tp2pp2dp1": "2x2:generate"}


@pytest.mark.slow
def test_four_process_layouts_match_hf(workdir, hf_reference) -> None:
    """TP2 x DP2 (with a PPO step) and TP2 x PP2, four gloo ranks on however many cores there are."""
    launch(4, ["--workdir", str(workdir), "--layouts", ",".join(FOUR_PROC.values())])
    for name in FOUR_PROC:
        result = torch.load(workdir / name / "result.pt", weights_only=False)
        assert_same_training(result, hf_reference)
        exported = AutoModelForCausalLM.from_pretrained(workdir / name / "hf")
        assert max_diff(exported.state_dict(), hf_reference["final"]) < WEIGHT_ATOL
    ppo = torch.load(workdir / "tp2pp1dp2" / "result.pt", weights_only=False)
    assert ppo["ppo_max_change"] > 1e-4
    assert max_diff(ppo["ppo_final"], hf_reference["ppo_final"]) < WEIGHT_ATOL


# --------------------------------------------------------------------------- through `areal train`


@pytest.mark.slow
def test_areal_train_with_tp2_matches_hf(ws) -> None:
    """The trainer end to end: `--nproc-per-node 2` with tensor_parallel_size=2 is ONE data-parallel
    replica (the backend tells the trainer so; both ranks get the whole batch), and trains like the
    hf backend in one process: same per-step losses, eval NLL and checkpointed weights."""
    import json
    import os
    import subprocess

    from safetensors.torch import load_file
    from test_cli_subprocess import areal_command
    from typer.testing import CliRunner

    from arealcli.main import app

    def recipe(name: str, backend: dict) -> Path:
        trainer = {"max_steps": 4, "eval_every_n_steps": 2, "tensorboard": False}
        eval_dataset = {"type_": "prompt_answer", "args": {"path": "test.jsonl"}, "batch_size": 8}
        data = sft_recipe(trainer=trainer, eval_dataset=eval_dataset)
        data["models"] = {"default": {"config": {**ARCH, "max_position_embeddings": 64}, "backend": backend}}
        return ws.text(name, yaml.safe_dump(data, sort_keys=False))

    # eps 1e-6: with Adam's default 1e-8 a handful of near-zero gradient entries turn ~1e-7 rounding
    # differences into ~1e-4 weight differences within 4 steps (single elements; losses agree).
    optimizer = {
        "lr": 1e-2,
        "eps": 1e-6,
        "lr_scheduler": "cosine",
        "warmup_steps_proportion": 0.2,
        "min_lr_ratio": 0.1,
    }
    hf_args = {"device": "cpu", "optimizer": optimizer}
    hf = CliRunner().invoke(
        app, ["train", str(recipe("hf.yaml", {"type_": "hf", "args": hf_args})), "-o", str(ws.root / "hf")]
    )
    assert hf.exit_code == 0, hf.output
    mg_args = {"tensor_parallel_size": 2, "optimizer": optimizer}
    mg_recipe = recipe("mg.yaml", {"type_": "megatron", "args": mg_args})
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [*areal_command(), "train", str(mg_recipe), "-o", str(ws.root / "mg"), "--nproc-per-node", "2"]
    mg = subprocess.run(cmd, cwd=ws.root, env=env, capture_output=True, text=True, timeout=240)
    assert mg.returncode == 0, mg.stdout + mg.stderr

    def rows(run: str) -> list[dict]:
        return [json.loads(line) for line in (ws.root / run / "metrics.jsonl").read_text().splitlines()]

    for a, b in zip(rows("hf"), rows("mg"), strict=True):
        for key in ("sft/loss", "eval/nll"):
            assert (key in a) == (key in b) and abs(a.get(key, 0) - b.get(key, 0)) < ATOL, (key, a, b)
    ckpt = "checkpoints/step_00000004/default/model.safetensors"
    assert max_diff(load_file(str(ws.root / "hf" / ckpt)), load_file(str(ws.root / "mg" / ckpt))) < ATOL


# --------------------------------------------------------------------------- one process


@pytest.fixture
def world_of_one():
    with gloo_world_of_one():
        yield


def megatron_model(tok, module, **args) -> Model:
    from arealcli.runtime.backends.megatron.backend import MegatronBackend

    backend = MegatronBackend(MegatronBackendArgs(**args))
    return backend.initialize(Model("m", module, tok), FinetuneSpec(1, 8, 8, N_STEPS))


def test_train_batch_is_independent_of_the_micro_batch_split(world_of_one, char_tok) -> None:
    module = tiny_module(char_tok, seed=1, **ARCH)
    batch = sft_batch(char_tok, seed=7)
    finals = []
    for spec in (MicroBatchSpec(), MicroBatchSpec(n_mbs=3), MicroBatchSpec(max_tokens_per_mb=20)):
        # eps 1e-4: Adam's first step is ~lr * sign(g), which turns rounding noise in near-zero
        # gradients into lr-sized differences; a larger eps keeps the comparison meaningful.
        model = megatron_model(char_tok, copy.deepcopy(module), optimizer={"lr": 1e-3, "eps": 1e-4})
        stats = model.module.train_batch(batch, spec, sft_loss, num_answer_tokens, version_steps=0)
        finals.append((stats["loss"], model.module.hf_state_dict()))
        model.backend.destroy(model)
    for loss, weights in finals[1:]:
        assert abs(loss - finals[0][0]) < 1e-6
        assert max_diff(weights, finals[0][1]) < 1e-6


def test_inference_only_model_forwards_and_refuses_to_train(world_of_one, char_tok) -> None:
    module = tiny_module(char_tok, seed=2, **ARCH)
    batch = sft_batch(char_tok, seed=8, bs=3)
    reference = copy.deepcopy(module)
    model = megatron_model(char_tok, module)  # no optimizer
    logits = model.module.forward(batch, MicroBatchSpec(n_mbs=2), aggregate_fn=list)
    with torch.no_grad():
        for ids, got in zip(batch.unpack("packed_input_ids"), logits, strict=True):
            torch.testing.assert_close(got, reference(ids[None]).logits[0], atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="no optimizer"):
        model.module.train_batch(batch, MicroBatchSpec(), sft_loss, num_answer_tokens, version_steps=0)
    model.backend.destroy(model)


def test_needs_torch_distributed(char_tok) -> None:
    with pytest.raises(RuntimeError, match="--nproc-per-node"):
        megatron_model(char_tok, tiny_module(char_tok, **ARCH))


def test_value_head_models_are_refused(world_of_one, char_tok) -> None:
    from arealcli.runtime.models.value_head import with_value_head

    with pytest.raises(NotImplementedError, match="hf or fsdp"):
        megatron_model(char_tok, with_value_head(tiny_module(char_tok, **ARCH), seed=0))


def test_parallel_sizes_must_divide_the_world(world_of_one, char_tok) -> None:
    with pytest.raises(ValueError, match="must divide the number of processes"):
        megatron_model(char_tok, tiny_module(char_tok, **ARCH), tensor_parallel_size=2)


def test_backend_is_registered_with_typed_args() -> None:
    from arealcli.schema import builtins  # noqa: F401  (fills the registries)
    from arealcli.schema.registry import BACKENDS

    entry = BACKENDS.get("megatron")
    assert entry.args_model is MegatronBackendArgs
    with pytest.raises(ValueError, match="tensor_parallel_sise"):
        MegatronBackendArgs.model_validate({"tensor_parallel_sise": 2})
