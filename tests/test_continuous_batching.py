"""Continuous batching in the scheduler of `areal serve`: concurrent samples share decoding steps,
samples join a running batch and leave it when done, and a sample gets the same tokens batched or alone."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

from arealcli.runtime.generation.model_runner import ModelRunner
from arealcli.runtime.generation.scheduler import Scheduler, Sequence
from arealcli.runtime.wire.sglang import Sampling
from tests.conftest import tiny_module

GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def module(char_tok):
    return tiny_module(char_tok, seed=3, max_position_embeddings=128)


def make_scheduler(module, char_tok, **kw) -> Scheduler:
    runner = ModelRunner.in_memory(module, char_tok, "tiny", device="cpu")
    scheduler = Scheduler(runner, continuous=True, **kw)
    scheduler.start()
    return scheduler


@pytest.fixture
def scheduler(module, char_tok):
    s = make_scheduler(module, char_tok)
    yield s
    s.stop()
    s.join(10)


def run(scheduler: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
    scheduler.submit(seqs)
    return wait(seqs)


def wait(seqs: list[Sequence]) -> list[Sequence]:
    for s in seqs:
        assert s.done.wait(60), f"{s.rid} did not finish"
        assert s.error is None, s.error
    return seqs


def seq(char_tok, text: str, sampling: Sampling = GREEDY, max_new: int = 8, rid: str = "r") -> Sequence:
    ids = char_tok(text, add_special_tokens=False)["input_ids"]
    return Sequence(rid, ids, dataclasses.replace(sampling, max_new_tokens=max_new), max_new)


PROMPTS = ["max(3,1,2)=", "7=", "max(37,82,15)=", "a", "12+30=", "max(9,99,1)=", "b b b", "z"]


def test_concurrent_samples_share_decoding_steps(scheduler, char_tok):
    n = 64
    seqs = [seq(char_tok, PROMPTS[i % len(PROMPTS)], Sampling(min_new_tokens=8), 8, str(i)) for i in range(n)]
    before = dict(scheduler.stats)
    run(scheduler, seqs)
    delta = {k: scheduler.stats[k] - before[k] for k in before}
    assert delta["samples"] == n and delta["tokens"] == 8 * n
    assert all(len(s.output_ids) == 8 and s.finished_as["type"] == "length" for s in seqs)
    # submitted together: one prefill, then 7 decoding steps for all 64 samples (not one pass each)
    assert delta["batches"] == 1 and delta["steps"] == 7 and delta["forwards"] == 8
    assert scheduler.stats["max_running"] == n


def test_greedy_tokens_are_the_same_batched_or_alone(scheduler, module, char_tok):
    """Different prompt lengths, lengths, stop tokens, min_new_tokens, stop texts and sampling params in
    one batch: every greedy sample gets the tokens (and log-probs) it gets alone."""
    first = run(scheduler, [seq(char_tok, PROMPTS[0], max_new=1)])[0].output_ids[0]

    def variants() -> list[Sequence]:
        out = [seq(char_tok, p, max_new=4 + 3 * i, rid=f"g{i}") for i, p in enumerate(PROMPTS)]
        out.append(seq(char_tok, PROMPTS[0], dataclasses.replace(GREEDY, stop_token_ids=(first,)), 8, "stop"))
        out.append(
            seq(
                char_tok,
                PROMPTS[0],
                dataclasses.replace(GREEDY, min_new_tokens=6, stop_token_ids=(first,)),
                8,
                "min",
            )
        )
        out.append(
            seq(
                char_tok, PROMPTS[2], dataclasses.replace(GREEDY, stop=(char_tok.decode([first]),)), 8, "text"
            )
        )
        out.append(
            seq(char_tok, PROMPTS[1], Sampling(temperature=0.7, top_k=5, min_new_tokens=5), 5, "sampled")
        )
        out.append(seq(char_tok, PROMPTS[3], GREEDY, 0, "empty"))
        return out

    together = run(scheduler, variants())
    alone = [run(scheduler, [s])[0] for s in variants()]
    for a, b in zip(together, alone, strict=True):
        if a.rid == "sampled":
            assert len(a.output_ids) == len(b.output_ids) == 5
            continue
        assert a.output_ids == b.output_ids, a.rid
        assert a.finished_as == b.finished_as, a.rid
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    by = {s.rid: s for s in together}
    assert by["stop"].output_ids == [first] and by["stop"].finished_as == {"type": "stop", "matched": first}
    assert len(by["min"].output_ids) >= 6 and first not in by["min"].output_ids[:6]
    assert by["empty"].output_ids == [] and by["empty"].finished_as["type"] == "length"

    # the same tokens as the whole-batch path (one generate call per sampling params)
    runner = scheduler.runner
    prompts = [s.prompt for s in together[: len(PROMPTS)]]
    whole = runner.generate(prompts, GREEDY, 4 + 3 * (len(PROMPTS) - 1), lambda: False)
    for s, row in zip(together[: len(PROMPTS)], whole, strict=True):
        assert s.output_ids == row.output_ids[: s.max_new_tokens], s.rid


def test_samples_join_a_running_batch_and_leave_when_done(module, char_tok):
    """A request that arrives while a long batch runs joins it between steps (not after it) and
    leaves when it is done, while the long samples go on."""
    scheduler = make_scheduler(module, char_tok)
    started = threading.Event()
    try:
        long = [seq(char_tok, p, Sampling(min_new_tokens=60), 60, f"long{i}") for i, p in enumerate(PROMPTS)]
        scheduler.forward_sleep_s = 0.01  # the long samples take ~0.6 s: the short ones arrive meanwhile
        for s in long:
            s.on_done = started.set
        scheduler.submit(long)
        while scheduler.stats["steps"] < 3:
            assert not started.is_set()
            threading.Event().wait(0.005)
        short = [seq(char_tok, p, Sampling(min_new_tokens=4), 4, f"short{i}") for i, p in enumerate(PROMPTS)]
        run(scheduler, short)
        assert not any(s.done.is_set() for s in long)  # the short samples left first
        wait(long)
    finally:
        scheduler.forward_sleep_s = 0.0
        scheduler.stop()
        scheduler.join(10)
    stats = scheduler.stats
    assert stats["samples"] == 2 * len(PROMPTS)
    assert stats["max_running"] == 2 * len(PROMPTS)  # the short samples ran in the long ones' steps
    assert stats["batches"] == 2 and stats["steps"] == 59  # 60 tokens: 1 prefill + 59 steps, shared
    assert all(len(s.output_ids) == 60 for s in long) and all(len(s.output_ids) == 4 for s in short)


def wait_for_steps(scheduler: Scheduler, n: int) -> None:
    """Until the scheduler has run `n` more decoding steps (samples are running)."""
    target = scheduler.stats["steps"] + n
    while scheduler.stats["steps"] < target:
        threading.Event().wait(0.005)


def test_abort_and_weight_update_while_running(char_tok, tmp_path):
    """abort_all ends the running samples with what they have; an update without abort waits for the
    running samples to finish, and samples after it run on the new weights."""
    own = tiny_module(char_tok, seed=3, max_position_embeddings=128)  # its weights get replaced
    scheduler = make_scheduler(own, char_tok, weight_version="v0")
    try:
        scheduler.forward_sleep_s = 0.01
        seqs = [seq(char_tok, p, Sampling(min_new_tokens=50), 50, f"a{i}") for i, p in enumerate(PROMPTS)]
        scheduler.submit(seqs)
        wait_for_steps(scheduler, 3)
        assert scheduler.abort_all("stop now") == 0  # nothing was queued; 8 were running
        wait(seqs)
        assert all(s.finished_as["type"] == "abort" and s.finished_as["message"] == "stop now" for s in seqs)
        assert all(0 < len(s.output_ids) < 50 and len(s.logprobs) == len(s.output_ids) for s in seqs)

        trained = tiny_module(char_tok, seed=4, max_position_embeddings=128)
        trained.save_pretrained(tmp_path / "v1")
        running = [seq(char_tok, p, Sampling(min_new_tokens=20), 20, f"b{i}") for i, p in enumerate(PROMPTS)]
        scheduler.submit(running)
        wait_for_steps(scheduler, 2)
        ok, message = scheduler.update_weights(str(tmp_path / "v1"), "v1", abort=False)
        assert ok, message
        assert all(s.done.is_set() and len(s.output_ids) == 20 for s in running)  # finished first
        assert all(s.weight_version == "v0" for s in running)
        scheduler.forward_sleep_s = 0.0
        after = run(scheduler, [seq(char_tok, PROMPTS[0], max_new=6)])[0]
        assert after.weight_version == "v1"
        alone = ModelRunner.in_memory(trained, char_tok, "v1", device="cpu")
        expected = alone.generate([after.prompt], GREEDY, 6, lambda: False)[0].output_ids
        assert after.output_ids == expected
    finally:
        scheduler.stop()
        scheduler.join(10)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_rows_that_join_and_leave_decode_as_they_do_alone(char_tok, family):
    """RowDecoder: rows prefilled at different steps, rows dropped midway, the cache grown while rows
    run: every row's greedy tokens and log-probs are those of the row decoded alone."""
    from arealcli.runtime.generation import decoder as lean_decoder
    from arealcli.runtime.generation import sampling as generation
    from arealcli.schema.components.engine import GenerationHyperparameters

    module = tiny_module(char_tok, seed=7, family=family, max_position_embeddings=128)
    prompts = [char_tok(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    steps = 10
    g = GenerationHyperparameters(greedy=True, max_new_tokens=steps)
    alone = [generation.generate(module, [p], g, set(), 0, "cpu") for p in prompts]

    dec = lean_decoder.RowDecoder(module, "cpu", torch.float32)
    got: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}
    live: list[int] = []  # prompt index of each row
    logits = None
    join_at = {0: [0, 1], 3: [2, 3, 4], 5: [5, 6, 7]}  # step -> prompts that join then
    for t in range(steps + 5):
        new = join_at.get(t, [])
        if new:
            add = dec.add([prompts[i] for i in new], [len(prompts[i]) + steps for i in new])
            logits = add if logits is None else torch.cat([logits, add])
            live += new
        if not live:
            break
        token, lp = generation.sample(logits, g)
        for row, i in enumerate(live):
            got.setdefault(i, []).append(int(token[row]))
            lps.setdefault(i, []).append(float(lp[row]))
        keep = [
            row for row, i in enumerate(live) if len(got[i]) < steps and not (i == 3 and len(got[i]) == 4)
        ]
        dec.keep(keep)
        live = [live[row] for row in keep]
        if live:
            logits = dec.step(token[keep])
    assert sorted(got) == list(range(len(PROMPTS)))
    for i, ref in enumerate(alone):
        n = len(got[i])
        assert got[i] == ref.output_ids[0][:n], i
        torch.testing.assert_close(torch.tensor(lps[i]), torch.tensor(ref.logprobs[0][:n]), atol=1e-5, rtol=0)
    assert len(got[3]) == 4 and all(len(got[i]) == steps for i in range(len(PROMPTS)) if i != 3)
    assert dec.rows == 0 and dec.capacity == (0, 0)  # the cache is freed with the last row


def test_an_update_that_cannot_load_returns_why_and_serving_goes_on(scheduler, char_tok, tmp_path):
    """In process (no confining folder): a folder that is missing, a file, a FIFO named like weights
    (opened without blocking: no writer ever comes) or a link loop is (False, why), never an exception;
    the update lock is free again and the next sample runs on the same weights."""
    before = run(scheduler, [seq(char_tok, PROMPTS[0], max_new=4)])[0].output_ids
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "model.safetensors")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    cases = {
        "missing": "no *.safetensors weights in",
        "file": "Not a directory",
        "fifo": "not a regular file",
        "loop": "symbolic links",
    }
    for name, why in cases.items():
        ok, message = scheduler.update_weights(str(tmp_path / name), "v9", abort=False)
        assert not ok and why in message, (name, message)
    assert scheduler.updates_waiting == 0 and scheduler.weight_version == "default"
    assert run(scheduler, [seq(char_tok, PROMPTS[0], max_new=4)])[0].output_ids == before
