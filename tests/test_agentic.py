"""Episodes with tool calls: masks through generation -> environment -> training (hf and the embedded
server), tool output never trained, the sandboxed executor's limits, checks, the agent quickstart."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.backends.sglang import SGLangBackend
from arealcli.runtime.data.datasets import PromptAnswerDataset
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
from arealcli.runtime.interfaces.reward import RewardInterface
from arealcli.runtime.interfaces.sft import SFTInterface, answer_token_mask
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.tools import ToolError, calculator, run_python
from arealcli.schema.components.backends import HFBackendArgs, SGLangBackendArgs
from arealcli.schema.components.datasets import PromptAnswerArgs
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import PPOActorArgs, RewardArgs, SFTArgs
from tests.conftest import REPO, load_example, tiny_module, train_until, with_returns, write_jsonl

SPEC = FinetuneSpec(1, 8, 8, 1000)
TOOL_USE = {"type_": "tool_use", "args": {"max_turns": 3, "max_total_tokens": 32}}


def mul_rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """The agent quickstart's format: a calculator call, its result, the answer."""
    return [
        {
            "prompt": f"{a}*{b}=",
            "answer": str(a * b),
            "episode": [
                {"role": "assistant", "content": f"[{a}*{b}]"},
                {"role": "tool", "content": f"={a * b} "},
                {"role": "assistant", "content": str(a * b)},
            ],
        }
        for a, b in pairs
    ]


PAIRS = [(417, 38), (205, 91), (733, 12), (560, 47), (128, 64), (999, 99), (310, 25), (684, 53)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, char_tok):
    """A tiny model fitted to eight worked episodes (SFT, loss on the model's turns): its greedy
    episodes call the calculator. Returns (model directory, dataset)."""
    root = tmp_path_factory.mktemp("agent")
    write_jsonl(root / "train.jsonl", mul_rows(PAIRS))
    data = PromptAnswerDataset(PromptAnswerArgs(path="train.jsonl", episode_key="episode"), char_tok, root)
    module = tiny_module(char_tok, seed=0, hidden_size=64, intermediate_size=128)
    model = HFBackend(HFBackendArgs(device="cpu", optimizer={"lr": 1e-2})).initialize(
        Model("actor", module, char_tok), SPEC
    )
    batch = data.collate(list(range(len(PAIRS))))
    sft = SFTInterface(SFTArgs())
    batch = batch.select(["packed_input_ids", "prompt_mask", "loss_mask"])
    # lr 1e-2 fits fast but not smoothly: at a loss of 0.02 a greedy answer can still be one token off
    # under some kernel sets (default: "[417*384" at 0.017); below 0.002 every one measured is exact
    train_until(
        lambda: sft.train_step(model, batch, MicroBatchSpec()), lambda s: s["loss"] < 0.002, 150, 1000
    )
    model.module.save_to_hf(char_tok, str(root / "model"))
    return root / "model", data


def actor_interface(**update) -> PPOActorInterface:
    args = {"workflow": TOOL_USE, "generation": {"greedy": True, "max_new_tokens": 12}, "adv_norm": "none"}
    return PPOActorInterface(PPOActorArgs.model_validate({**args, **update}))


def hf_actor(model_dir: Path, char_tok, lr: float = 1e-3) -> Model:
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return HFBackend(HFBackendArgs(device="cpu", optimizer={"type": "sgd", "lr": lr})).initialize(
        Model("actor", module, char_tok), SPEC
    )


def segments(ids: list[int], mask: list[bool]) -> list[tuple[bool, list[int]]]:
    """Runs of equal mask: [(is the model's, token ids)]."""
    out: list[tuple[bool, list[int]]] = []
    for t, m in zip(ids, mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def check_episodes(out: SequenceSample, data, tok) -> int:
    """Every episode: prompt (not trained) -> model call -> tool result (not trained, what the calculator
    says for the call) -> model answer; log-probs 0 where the tool wrote. Returns how many called."""
    called = 0
    prompts = [data.items[i]["prompt_ids"] for i, _ in out.ids]
    for ids, pm, lm, lp, prompt in zip(
        out.unpack("packed_input_ids"), out.unpack("prompt_mask"), out.unpack("loss_mask"),
        out.unpack("packed_logprobs"), prompts, strict=True,
    ):  # fmt: skip
        ids, pm, lm = ids.tolist(), pm.bool(), lm.bool()
        assert ids[: len(prompt)] == prompt and int(pm.sum()) == len(prompt)
        assert not lm[pm].any()  # the prompt never trains
        parts = segments(ids[len(prompt) :], lm[len(prompt) :].tolist())
        assert parts[0][0], "an episode starts with the model's tokens"
        for k, (own, toks) in enumerate(parts):
            if own:
                continue
            call = tok.decode(parts[k - 1][1])
            assert call.startswith("[") and call.endswith("]"), call
            assert tok.decode(toks) == f"={calculator(call[1:-1])} "  # the tool's own answer, verbatim
            called += 1
        # log-probs at the positions that predict tool tokens are 0 (the tool is not the policy)
        predicts_tool = torch.roll(~lm & ~pm, -1)
        predicts_tool[-1] = False
        assert (lp[predicts_tool] == 0).all()
    return called


def test_tool_call_episodes_round_trip_through_training_on_hf(trained, char_tok):
    model_dir, data = trained
    actor = hf_actor(model_dir, char_tok)
    interface = actor_interface()
    batch = data.collate(list(range(len(PAIRS)))).select(["packed_prompts", "answers", "prompt"])
    out = interface.generate(actor, batch.select(["packed_prompts"]), MicroBatchSpec())
    assert check_episodes(out, data, char_tok) >= len(PAIRS) - 1
    stats = out.stats
    assert stats["episode/tool_call_rate"] >= (len(PAIRS) - 1) / len(PAIRS) and stats["episode/turns"] >= 2

    # the log-probs of the model's tokens are the policy's own (one full forward pass)
    recomputed = interface.inference(actor, out.select(["packed_input_ids"]), MicroBatchSpec())
    own = torch.roll(out.data["loss_mask"].bool(), -1)
    own[out.cu_seqlens("packed_input_ids")[1:] - 1] = False
    assert torch.allclose(
        out.data["packed_logprobs"][own], recomputed.data["packed_logprobs"][own], atol=1e-4
    )

    # the reward scores the final answer (the text after the last tool result)
    out.meta["answers"] = [batch.meta["answers"][i] for i, _ in out.ids]
    rewards = RewardInterface(RewardArgs(reward_fn="math")).inference(
        Model("reward", None, char_tok), out.select(["packed_input_ids", "prompt_mask", "answers", "loss_mask"]),
        MicroBatchSpec(),
    ).data["rewards"]  # fmt: skip
    finals = [
        char_tok.decode(segments(ids.tolist(), lm.bool().tolist())[-1][1], skip_special_tokens=True)
        for ids, lm in zip(out.unpack("packed_input_ids"), out.unpack("loss_mask"), strict=True)
    ]
    expected = [float(f.strip() == a[0]) for f, a in zip(finals, out.meta["answers"], strict=True)]
    assert rewards.tolist() == expected and sum(expected) >= len(PAIRS) / 2

    # training: the actions are exactly the model's own tokens
    out.update_(SequenceSample(out.ids, {"rewards": [1] * out.bs}, {"rewards": rewards - 0.5}))
    train = out.select(
        ["packed_input_ids", "prompt_mask", "loss_mask", "packed_logprobs", "seq_no_eos_mask", "rewards"]
    )
    assert torch.equal(answer_token_mask(train), own)
    before = {k: v.clone() for k, v in actor.module.module.state_dict().items()}
    result = interface.train_step(actor, with_returns(train), MicroBatchSpec(n_mbs=2))
    assert result["n_updates"] == 1 and torch.isfinite(torch.tensor(result["loss"]))
    assert any(not torch.equal(before[k], v) for k, v in actor.module.module.state_dict().items())


def test_episodes_on_the_embedded_server_match_hf(trained, char_tok, tmp_path):
    from arealcli.runtime.clients import launcher
    from tests.test_server import start_servers

    model_dir, data = trained
    batch = data.collate(list(range(len(PAIRS)))).select(["packed_prompts"])
    interface = actor_interface()
    local = interface.generate(hf_actor(model_dir, char_tok), batch, MicroBatchSpec())
    servers = start_servers(model_dir, tmp_path)
    try:
        backend = SGLangBackend(SGLangBackendArgs(addresses=[servers[0].address]))
        remote_model = backend.initialize(Model("actor_gen", None, char_tok), SPEC)
        try:
            remote = interface.generate(remote_model, batch, MicroBatchSpec())
        finally:
            backend.destroy(remote_model)
    finally:
        launcher.stop(servers)
    assert check_episodes(remote, data, char_tok) >= len(PAIRS) - 1
    for key in ("packed_input_ids", "prompt_mask", "loss_mask", "seq_no_eos_mask"):
        assert torch.equal(remote.data[key], local.data[key]), key
    assert torch.allclose(remote.data["packed_logprobs"], local.data["packed_logprobs"], atol=1e-4)


# --------------------------------------------------------------------------- tool output never trains


def episode_batch(char_tok, tail: str, tail_logprob: float, first_answer: str = "12") -> SequenceSample:
    """Two episodes of one prompt: model call, tool result, model answer, then tool output cut by the
    token budget (`tail`: nothing of the model follows it)."""
    tok = lambda s: char_tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    seqs, pms, lms, lps = [], [], [], []
    for answer in (first_answer, "99"):
        parts = [("4*3=", None), ("[4*3]", True), ("=12 ", False), (answer, True), (tail, False)]
        ids, pm, lm, lp = [], [], [], []
        for text, own in parts:
            t = tok(text)
            ids += t
            pm += [own is None] * len(t)
            lm += [bool(own)] * len(t)
            lp += [-0.7 if own else (tail_logprob if text == tail else 0.0)] * len(t)
        seqs.append(torch.tensor(ids))
        pms.append(torch.tensor(pm))
        lms.append(torch.tensor(lm))
        lps.append(torch.tensor(lp[1:] + [0.0]))  # position t holds the log-prob of token t+1
    return SequenceSample.from_lists(
        [(0, 0), (0, 1)],
        {
            "packed_input_ids": seqs,
            "prompt_mask": pms,
            "loss_mask": lms,
            "packed_logprobs": lps,
            "seq_no_eos_mask": [torch.tensor([1.0]), torch.tensor([1.0])],
            "rewards": [torch.tensor([1.0]), torch.tensor([0.0])],
        },
    )


def test_tool_output_tokens_get_no_gradient(char_tok):
    """Changing the tool's tokens (and the log-probs recorded there) at the end of an episode changes
    nothing in the update; changing a model token does (so the comparison can fail)."""
    base = tiny_module(char_tok, seed=3)

    def update(batch: SequenceSample) -> dict[str, torch.Tensor]:
        model = HFBackend(HFBackendArgs(device="cpu", optimizer={"type": "sgd", "lr": 0.5})).initialize(
            Model("actor", copy.deepcopy(base), char_tok), SPEC
        )
        PPOActorInterface(PPOActorArgs(adv_norm="group", generation={"n": 2})).train_step(
            model, with_returns(batch), MicroBatchSpec()
        )
        return {k: v.clone() for k, v in model.module.module.state_dict().items()}

    ref = update(episode_batch(char_tok, "=error: x", 0.0))
    same = update(episode_batch(char_tok, "=zzzzzzzz", -5.0))
    assert all(torch.equal(ref[k], same[k]) for k in ref)
    changed = update(episode_batch(char_tok, "=error: x", 0.0, first_answer="13"))
    assert any(not torch.equal(ref[k], changed[k]) for k in ref)
    # and without the mask the same tool tokens would train: the mask is what keeps them out
    unmasked = episode_batch(char_tok, "=error: x", 0.0)
    del unmasked.data["loss_mask"], unmasked.seqlens["loss_mask"]
    assert any(not torch.equal(ref[k], v) for k, v in update(unmasked).items())


# --------------------------------------------------------------------------- tools


def test_calculator_parses_with_ast_and_refuses_the_rest():
    assert calculator("417*38") == "15846"
    assert calculator(" (2 + 3) * 4 - 6 / 4 ") == "18.5"
    assert calculator("2**10 // 3 % 7") == str(2**10 // 3 % 7)
    for bad in ("__import__('os').system('id')", "x + 1", "9**9**9", "1/0", "[1,2]", ""):
        with pytest.raises(ToolError):
            calculator(bad)


HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "infinite loop": "while True:\n    pass",
    "10 GB": "x = bytearray(10 * 1024**3)\nprint(len(x))",
    "network": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)\nprint('connected')",
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_python_executor_contains_hostile_code(what):
    t0 = time.monotonic()
    with pytest.raises(ToolError) as e:
        run_python(HOSTILE[what], timeout_s=2.0, memory_mb=256)
    assert time.monotonic() - t0 < 15  # the time limit holds (with room for a loaded machine)
    assert "connected" not in str(e.value)
    assert str(e.value).startswith("python: ")
    assert run_python("print(6 * 7)") == "42"  # and the executor still works afterwards


CHAOS_PLUGIN = '''
"""A tool that runs hostile programs in the sandbox, one per call (fault injection)."""
import itertools
from arealcli.runtime.tools import register_tool, run_python

PROGRAMS = itertools.cycle({programs!r})


def chaos(arg: str) -> str:
    return run_python(next(PROGRAMS), timeout_s=1.0, memory_mb=256)


register_tool("chaos", chaos)
'''


def test_training_goes_on_while_the_tool_fails(ws, cli):
    """Every tool call runs a fork bomb, an endless loop, a 10 GB allocation or a network call; each
    comes back to the model as a tool error and the run finishes its steps."""
    (ws.root / "chaos_tool.py").write_text(CHAOS_PLUGIN.format(programs=list(HOSTILE.values())))
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "episode": [
            {"role": "assistant", "content": "[go]"},
            {"role": "tool", "content": "=ok "},
            {"role": "assistant", "content": str(a + b)},
        ]}
        for a in range(4) for b in range(4)
    ]  # fmt: skip
    write_jsonl(ws.root / "ep.jsonl", rows)
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart-agent.yaml").read_text())
    recipe["imports"] = ["chaos_tool"]
    recipe["models"]["actor"]["backend"]["args"]["optimizer"]["lr"] = 1e-2
    recipe["models"]["actor"]["config"] = {"family": "qwen2", "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
        "max_position_embeddings": 64}  # fmt: skip
    recipe["dataset"] = {"type_": "prompt_answer", "args": {"path": "ep.jsonl", "episode_key": "episode"},
                         "batch_size": 4}  # fmt: skip
    del recipe["eval_dataset"]
    df = recipe["dataflow"]
    df["sft_warmup_steps"] = 30
    df["actor"]["workflow"]["args"] = {"tools": ["chaos"], "max_turns": 2, "max_total_tokens": 24}
    df["actor"]["generation"] = {"n": 2, "max_new_tokens": 8, "temperature": 0.5}
    recipe["trainer"] = {"max_steps": 32, "log_every_n_steps": 1, "samples_every_n_steps": 32}
    path = ws.text("chaos.yaml", yaml.safe_dump(recipe))
    result = cli("train", path, "-o", ws.root / "run")
    assert result.exit_code == 0, result.output + result.stderr
    metrics = [json.loads(line) for line in (ws.root / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if "actor_gen/episode/tool_calls" in m]
    assert len(rl) == 2 and sum(m["actor_gen/episode/tool_errors"] for m in rl) > 0
    samples = (ws.root / "run" / "samples" / "step_00000032.jsonl").read_text()
    assert "=error:" in samples


# --------------------------------------------------------------------------- checks


def check_lines(cli, path) -> list[str]:
    result = cli("check", path)
    assert result.exit_code == 2, result.output
    return result.stderr.strip().splitlines()


def agent_recipe(ws, **workflow_args) -> Path:
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart-agent.yaml").read_text())
    for key in ("dataset", "eval_dataset"):
        recipe[key]["args"]["path"] = str(REPO / "data" / "mul" / "train.jsonl")
    recipe["dataflow"]["actor"]["workflow"]["args"].update(workflow_args)
    return ws.text("agent.yaml", yaml.safe_dump(recipe, sort_keys=False))


def test_check_refuses_python_unless_allowed_and_types_workflow_args(ws, cli):
    text = "\n".join(check_lines(cli, agent_recipe(ws, tools=["calculator", "python"])))
    assert "dataflow.actor.workflow" in text and "allow_python: true" in text
    assert cli("check", agent_recipe(ws, tools=["python"], allow_python=True)).exit_code == 0

    text = "\n".join(check_lines(cli, agent_recipe(ws, tools=["calculater"], max_turns=0)))
    assert "calculater" in text and "calculator" in text  # names the unknown tool, suggests the real one

    text = "\n".join(check_lines(cli, agent_recipe(ws, max_turns="3")))
    assert "max_turns" in text

    recipe = yaml.safe_load(agent_recipe(ws).read_text())
    recipe["dataflow"]["actor"]["workflow"]["type_"] = "tool_uses"
    text = "\n".join(check_lines(cli, ws.text("bad.yaml", yaml.safe_dump(recipe))))
    assert "tool_uses" in text and "tool_use" in text


def test_list_shows_workflows_and_tools(cli):
    result = cli("list")
    assert result.exit_code == 0
    for name in ("tool_use", "calculator", "python"):
        assert name in result.output


# --------------------------------------------------------------------------- the agent quickstart


def async_agent_recipe(path: Path) -> Path:
    """The agent quickstart with asynchronous rollout: a `local` generator runs up to 2 steps ahead."""
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart-agent.yaml").read_text())
    recipe["models"]["actor_gen"] = {
        "init_from": "actor",
        "weights_from": "actor",
        "backend": {"type_": "local"},
    }
    recipe["rollout"] = {"max_staleness": 2}
    recipe["dataflow"]["actor"].update(use_decoupled_loss=True, behav_imp_weight_cap=5.0)
    for key in ("dataset", "eval_dataset"):
        recipe[key]["args"]["path"] = str(REPO / "data" / "mul" / Path(recipe[key]["args"]["path"]).name)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("rollout", ["sync", "async"])
def test_agent_quickstart_learns_to_use_the_calculator(tmp_path, rollout):
    import subprocess
    import sys

    run = tmp_path / "run"
    recipe = REPO / "recipes" / "quickstart-agent.yaml"
    if rollout == "async":
        recipe = async_agent_recipe(tmp_path / "agent-async.yaml")
    done = subprocess.run(
        [sys.executable, "-m", "arealcli.main", "train", str(recipe), "-o", str(run)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held_out = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert held_out[0] < 0.1 and held_out[-1] >= 0.6, held_out
    rewards = [m["actor_train/reward"] for m in metrics if "actor_train/reward" in m]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards  # RL raises the sampled reward
    rate = [m["actor_gen/episode/tool_call_rate"] for m in metrics if "actor_gen/episode/tool_call_rate" in m]
    assert rate[-1] > 0.9
    rows = [json.loads(line) for line in (run / "samples" / "step_00000200.jsonl").read_text().splitlines()]
    assert sum("=" in r["response"] and r["reward"] == 1.0 for r in rows) > len(rows) / 2  # whole episodes


# --------------------------------------------------------------------------- OpenAI-compatible serving

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)


@pytest.fixture(scope="module")
def openai_server(trained, char_tok, tmp_path_factory):
    """The embedded server on the calculator-trained model, with a chat template."""
    import shutil

    from arealcli.runtime.clients import launcher
    from tests.test_server import start_servers

    model_dir = tmp_path_factory.mktemp("oai") / "model"
    shutil.copytree(trained[0], model_dir)
    tok = copy.deepcopy(char_tok)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(model_dir)
    servers = start_servers(model_dir, tmp_path_factory.mktemp("oai-logs"))
    yield servers[0], model_dir
    launcher.stop(servers)


def test_openai_client_completions_with_token_ids_and_logprobs(openai_server, trained, char_tok):
    openai = pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM

    from tests.test_server import own_logprobs

    server, model_dir = openai_server
    client = openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [str(model_dir)]

    # the agent loop of the quickstart, written against the OpenAI API: call, run the tool, continue
    prompt = "417*38="
    first = client.completions.create(
        model="policy", prompt=prompt, max_tokens=12, temperature=0, stop="]", logprobs=0
    )
    call = first.choices[0]
    # as with OpenAI the stop text is not in `text`; `stop_reason` names it, `token_ids` keep its token
    assert call.text == "[417*38" and call.finish_reason == "stop" and call.model_extra["stop_reason"] == "]"
    result = f"]={calculator(call.text[1:])} "
    second = client.completions.create(
        model="policy", prompt=prompt + call.text + result, max_tokens=12, temperature=0, logprobs=0
    )
    assert second.choices[0].finish_reason == "stop" and second.choices[0].model_extra["stop_reason"] is None
    # the same episode as the tool_use workflow's on the in-process engine
    data = SequenceSample.from_lists([0], {"packed_prompts": [torch.tensor(char_tok(prompt)["input_ids"])]})
    episode = actor_interface().generate(hf_actor(trained[0], char_tok), data, MicroBatchSpec())
    text = char_tok.decode(episode.data["packed_input_ids"].tolist(), skip_special_tokens=True)
    assert text == prompt + call.text + result + second.choices[0].text

    # token ids and log-probs: what training needs, and the policy's own
    extra = call.model_extra
    assert extra["prompt_token_ids"] == char_tok(prompt, add_special_tokens=False)["input_ids"]
    assert char_tok.decode(extra["token_ids"]) == "[417*38]"
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    own = own_logprobs(reference, extra["prompt_token_ids"], extra["token_ids"])
    assert max(abs(a - b) for a, b in zip(call.logprobs.token_logprobs, own, strict=True)) < 1e-4
    assert call.logprobs.tokens == [char_tok.decode([t]) for t in extra["token_ids"]]
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == len(
        extra["token_ids"]
    )

    # a stop text of several tokens ends the sample at the token that completes it; the text stops before it
    multi = client.completions.create(
        model="p", prompt=prompt, max_tokens=12, temperature=0, stop=["*38", "zz"]
    )
    c = multi.choices[0]
    assert c.text == "[417" and c.finish_reason == "stop" and c.model_extra["stop_reason"] == "*38"
    assert char_tok.decode(c.model_extra["token_ids"]) == "[417*38"  # no token generated past it
    assert c.model_extra["token_ids"] == extra["token_ids"][:7]

    # batches of prompts, n samples each; max_tokens cuts with finish_reason length
    many = client.completions.create(
        model="p",
        prompt=["205*91=", "733*12="],
        n=3,
        max_tokens=4,
        temperature=1.0,
        extra_body={"min_tokens": 4},
    )
    assert len(many.choices) == 6 and [c.index for c in many.choices] == list(range(6))
    assert all(c.finish_reason == "length" and len(c.model_extra["token_ids"]) == 4 for c in many.choices)


def test_openai_client_chat_and_refusals(openai_server, char_tok):
    openai = pytest.importorskip("openai")
    server, _ = openai_server
    client = openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
    )
    c = chat.choices[0]
    rendered = char_tok.decode(c.model_extra["prompt_token_ids"])
    assert rendered == "u: hi\na: " and chat.object == "chat.completion"
    assert c.message.role == "assistant" and len(c.logprobs.content) == len(c.model_extra["token_ids"])
    assert c.message.content == char_tok.decode(c.model_extra["token_ids"], skip_special_tokens=True)

    for kwargs, said in [
        ({"extra_body": {"echo": True}}, "echo"),
        ({"tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}]}, "known format"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], **kwargs)
        assert said in str(e.value), (kwargs, str(e.value))


WORKFLOW_PLUGIN = '''
"""A workflow of one's own: one generation turn, then the environment says "ok" (not trained)."""
from dataclasses import dataclass

from arealcli.api import Episode, MicroBatchSpec, SequenceSample, register_workflow
import torch


@dataclass
class EchoArgs:
    reply: str = " ok"
    turns: int = 1


class Echo:
    Args = EchoArgs

    def __init__(self, args):
        self.args = args

    def run(self, engine, tokenizer, prompts, gconfig):
        batch = SequenceSample.from_lists(list(range(len(prompts))), {"packed_prompts": [torch.tensor(p) for p in prompts]})
        out = engine.generate(batch, MicroBatchSpec(), tokenizer, gconfig)
        reply = tokenizer(self.args.reply, add_special_tokens=False)["input_ids"]
        return [
            Episode(tokens=list(ids) + reply, mask=[True] * len(ids) + [False] * len(reply),
                    logprobs=list(lps) + [0.0] * len(reply), no_eos=False, turns=1)
            for ids, lps in zip(out.output_ids, out.logprobs)
        ]


register_workflow("echo", Echo)
'''


def test_a_plugin_workflow_is_checked_and_trains(ws, cli):
    (ws.root / "echo_workflow.py").write_text(WORKFLOW_PLUGIN)
    recipe = yaml.safe_load(agent_recipe(ws).read_text())
    recipe["imports"] = ["echo_workflow"]
    recipe["dataflow"]["actor"]["workflow"] = {"type_": "echo", "args": {"turns": "2"}}
    text = "\n".join(check_lines(cli, ws.text("echo.yaml", yaml.safe_dump(recipe))))
    assert "turns" in text and "integer" in text  # the plugin's own args, typed
    recipe["dataflow"]["actor"]["workflow"]["args"] = {"reply": " fine"}
    recipe["dataset"]["args"]["limit"] = 16
    recipe["dataset"]["batch_size"] = 4
    recipe["eval_dataset"]["args"]["limit"] = 8
    recipe["dataflow"]["sft_warmup_steps"] = 1
    recipe["trainer"] = {"max_steps": 3, "log_every_n_steps": 1, "samples_every_n_steps": 3}
    result = cli("train", ws.text("echo.yaml", yaml.safe_dump(recipe)), "-o", ws.root / "run")
    assert result.exit_code == 0, result.output + result.stderr
    rows = [
        json.loads(x) for x in (ws.root / "run" / "samples" / "step_00000003.jsonl").read_text().splitlines()
    ]
    assert rows and all(r["response"].endswith(" fine") for r in rows)


def test_tool_calls_as_text_or_as_chat_template_json():
    from arealcli.runtime.agents.workflows import ToolUseWorkflow
    from arealcli.schema.components.workflows import ToolUseArgs

    one = ToolUseWorkflow(ToolUseArgs(tools=["calculator"]))
    assert one._call("2*3") == ("6", True)
    assert one._call('{"name": "calculator", "arguments": {"expression": "2*3"}}') == ("6", True)
    result, ok = one._call("2*x")
    assert not ok and result.startswith("error: ")
    assert one._call('{"name": "calc"}')[0].startswith("error: no tool 'calc'")
    assert one._call('{"oops": 1}') == ('error: a JSON tool call is {"name": ..., "arguments": ...}', False)
    two = ToolUseWorkflow(ToolUseArgs(tools=["calculator", "python"], allow_python=True))
    assert two._call("calculator: 7*6") == ("42", True)


def test_a_tool_that_hangs_answers_with_an_error():
    import threading

    from arealcli.runtime.agents.workflows import run_tool

    release = threading.Event()

    def stuck(arg: str) -> str:
        release.wait()
        return "late"

    start = time.monotonic()
    assert run_tool({"stuck": stuck}, "stuck", "x", timeout_s=0.2) == (
        "error: stuck gave no answer within 0.2 s",
        False,
    )
    assert time.monotonic() - start < 2
    release.set()
    assert run_tool({"calc": calculator}, "calc", {"expression": "6*7"}) == ("42", True)


def test_check_wants_a_value_head_on_critics_only(ws, cli):
    recipe = yaml.safe_load(agent_recipe(ws).read_text())
    recipe["models"]["critic"] = {"init_from": "actor", "backend": recipe["models"]["actor"]["backend"]}
    recipe["dataflow"]["preset"] = "ppo"
    recipe["dataflow"]["actor"]["adv_norm"] = "batch"
    (line,) = check_lines(cli, ws.text("ppo.yaml", yaml.safe_dump(recipe)))[1:]
    assert "models.critic" in line and "add `value_head: true`" in line
    recipe["models"]["critic"]["value_head"] = True
    recipe["models"]["actor"]["value_head"] = True
    (line,) = check_lines(cli, ws.text("ppo.yaml", yaml.safe_dump(recipe)))[1:]
    assert "models.actor.value_head" in line and "language model" in line


# --------------------------------------------------------------------------- workflows written as OpenAI-client agents


def load_example_agent():
    return load_example("calculator_agent")


def test_an_openai_client_agent_generates_the_same_episodes_as_tool_use(trained, char_tok):
    """The calculator loop written as OpenAI-client code (examples/calculator_agent.py) gives, in process,
    the very episodes of the built-in tool_use workflow: tokens, masks and log-probs."""
    load_example_agent()
    model_dir, data = trained
    actor = hf_actor(model_dir, char_tok)
    batch = data.collate(list(range(len(PAIRS)))).select(["packed_prompts"])
    reference = actor_interface().generate(actor, batch, MicroBatchSpec())
    agent = actor_interface(workflow={"type_": "calculator_agent", "args": {"max_total_tokens": 32}})
    episodes = agent.generate(actor, batch, MicroBatchSpec())
    assert check_episodes(episodes, data, char_tok) >= len(PAIRS) - 1
    for key in ("packed_input_ids", "prompt_mask", "loss_mask", "seq_no_eos_mask"):
        assert torch.equal(episodes.data[key], reference.data[key]), key
    assert torch.allclose(episodes.data["packed_logprobs"], reference.data["packed_logprobs"], atol=1e-6)
    assert episodes.stats["episode/tool_call_rate"] == reference.stats["episode/tool_call_rate"]


def test_the_same_agent_code_runs_against_areal_serve(openai_server, trained, char_tok):
    openai = pytest.importorskip("openai")
    agent = load_example_agent().calculator_agent
    server, _ = openai_server
    client = openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="unused", max_retries=0)
    model_dir, data = trained
    actor = hf_actor(model_dir, char_tok)
    for a, b in PAIRS[:3]:
        prompt = f"{a}*{b}="
        over_http = agent(client, prompt, temperature=0)
        data1 = SequenceSample.from_lists(
            [0], {"packed_prompts": [torch.tensor(char_tok(prompt)["input_ids"])]}
        )
        episode = actor_interface().generate(actor, data1, MicroBatchSpec())
        _, (final,) = decode_final(episode, char_tok)
        assert over_http == final


def decode_final(out: SequenceSample, tok):
    from arealcli.runtime.data.responses import decode_responses

    return decode_responses(tok, out)


AGENT_PLUGIN = """
from arealcli.runtime.agents.agent import AgentWorkflow
from arealcli.schema.registry import register_workflow


class Rewriter(AgentWorkflow):
    def episode(self, client, prompt):
        first = client.completions.create(model="p", prompt=prompt, max_tokens=3)
        client.completions.create(model="p", prompt="something else entirely", max_tokens=3)


class Hot(AgentWorkflow):
    def episode(self, client, prompt):
        client.completions.create(model="p", prompt=prompt, max_tokens=3, temperature=0.3)


class Hung(AgentWorkflow):
    # the second episode's tool never answers

    def episode(self, client, prompt):
        call = client.completions.create(model="p", prompt=prompt, max_tokens=3)
        if "205" in prompt:
            import time

            time.sleep(30)
        client.completions.create(model="p", prompt=prompt + call.choices[0].text + "=", max_tokens=3)


register_workflow("rewriter", Rewriter)
register_workflow("hot", Hot)
register_workflow("hung", Hung)
"""


def test_agent_mistakes_are_clear_errors(trained, char_tok, tmp_path, monkeypatch):
    from arealcli.errors import UserError

    (tmp_path / "bad_agents.py").write_text(AGENT_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("bad_agents")
    model_dir, data = trained
    actor = hf_actor(model_dir, char_tok)
    batch = data.collate([0, 1]).select(["packed_prompts"])
    with pytest.raises(UserError, match="must each extend the previous request"):
        actor_interface(workflow={"type_": "rewriter"}).generate(actor, batch, MicroBatchSpec())
    with pytest.raises(UserError, match="temperature=0.3.*recipe's generation"):
        actor_interface(workflow={"type_": "hot"}).generate(actor, batch, MicroBatchSpec())
    hung = actor_interface(workflow={"type_": "hung", "args": {"episode_timeout_s": 1}})
    start = time.monotonic()
    with pytest.raises(UserError, match=r"episode\(s\) \[1\] neither asked the model nor finished for 1 s"):
        hung.generate(actor, batch, MicroBatchSpec())
    assert time.monotonic() - start < 10


CHAT_AGENT_PLUGIN = """
from arealcli.runtime.agents.agent import AgentWorkflow
from arealcli.schema.registry import register_workflow


class TwoTurnChat(AgentWorkflow):
    def episode(self, client, prompt):
        messages = [{"role": "user", "content": prompt}]
        for question in ("again", None):
            reply = client.chat.completions.create(model="p", messages=messages, max_tokens=4)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if question:
                messages.append({"role": "user", "content": question})


register_workflow("two_turn_chat", TwoTurnChat)
"""


def test_a_chat_agent_trains_on_its_own_turns_only(char_tok, tmp_path, monkeypatch):
    (tmp_path / "chat_agents.py").write_text(CHAT_AGENT_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("chat_agents")
    tok = copy.deepcopy(char_tok)
    tok.chat_template = CHAT_TEMPLATE
    actor = HFBackend(HFBackendArgs(device="cpu")).initialize(
        Model("actor", tiny_module(tok, seed=5), tok), SPEC
    )
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in ("hi", "yo")]  # plain questions
    batch = SequenceSample.from_lists([0, 1], {"packed_prompts": [torch.tensor(p) for p in prompts]})
    interface = PPOActorInterface(
        PPOActorArgs.model_validate(
            {
                "workflow": {"type_": "two_turn_chat", "args": {"max_total_tokens": 40}},
                "generation": {"max_new_tokens": 4},
            }
        )
    )
    out = interface.generate(actor, batch, MicroBatchSpec())
    for ids, lm, q in zip(out.unpack("packed_input_ids"), out.unpack("loss_mask"), ("hi", "yo"), strict=True):
        parts = segments(ids.tolist(), lm.bool().tolist())
        own = [tok.decode(t) for mine, t in parts if mine]
        assert len(own) == 2  # two assistant replies train ...
        inserted = [tok.decode(t) for mine, t in parts if not mine]
        assert inserted[0] == f"u: {q}\na: " and "u: again\na: " in inserted[1]  # ... the user turns never do


def test_areal_eval_scores_episodes_as_training_generates_them(trained, char_tok, tmp_path):
    """`areal eval` with the agent recipe: greedy tool-use episodes of the fitted model, scored on their
    final answers, exactly as the actor's held-out evaluation scores them; --no-workflow asks for plain
    completions (a calculator call is no answer)."""
    from typer.testing import CliRunner

    from arealcli.main import app

    recipe = tmp_path / "agent.yaml"
    text = (REPO / "recipes" / "quickstart-agent.yaml").read_text().replace("../data/", f"{REPO}/data/")
    recipe.write_text(text)
    rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in PAIRS]
    write_jsonl(tmp_path / "pairs.jsonl", rows)

    def accuracy(*flags: str) -> float:
        out = tmp_path / "results.json"
        args = ["eval", str(trained[0]), "--recipe", str(recipe), "--data", str(tmp_path / "pairs.jsonl")]
        result = CliRunner().invoke(app, [*args, "--n", "2", "-o", str(out), *flags])
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())["metrics"]["greedy_accuracy"]

    data = PromptAnswerDataset(PromptAnswerArgs(path="pairs.jsonl"), char_tok, tmp_path)
    actor = actor_interface(eval_reward_fn="math", generation={"max_new_tokens": 12})
    expected = actor.evaluate(hf_actor(trained[0], char_tok), [data.collate(list(range(len(rows))))])
    assert accuracy() == expected["accuracy"] >= 0.5
    assert accuracy("--no-workflow") == 0.0
