"""OpenAI function calling: `tools` rendered by the chat template, Hermes-style `<tool_call>` JSON the
model writes parsed into `message.tool_calls`, on `areal serve` (the `openai` package over HTTP) and
in process (examples/function_calling_agent.py generating training episodes)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
from arealcli.runtime.interfaces.sft import SFTInterface
from arealcli.runtime.models.model import Model
from arealcli.runtime.wire.openai import OfferedTools, ProtocolError, chat_message, parse_tools
from arealcli.runtime.wire.tool_calls import FORMATS
from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import PPOActorArgs, SFTArgs
from tests.conftest import load_example, tiny_module, train_until
from tests.test_agentic import PAIRS, SPEC, hf_actor, segments

# A compact chat template in the Hermes style of Qwen2.5's: the tools' names up front, calls written as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> inside the assistant turn.
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}a: {{ m.content or '' }}"
    '{% for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{{ eos_token }}{{ '\\n' }}"
    "{% elif m.role == 'tool' %}r: {{ m.content }}{{ '\\n' }}"
    "{% else %}u: {{ m.content }}{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}a: {% endif %}"
)


EXAMPLE = load_example("function_calling_agent")
TOOLS = EXAMPLE.TOOLS  # a calculator: {"expression": ...}


def call_text(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}\n</tool_call>'


def calculator_call(a: int, b: int) -> dict:
    arguments = json.dumps({"expression": f"{a}*{b}"})
    return {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}


def conversation(a: int, b: int) -> list[tuple[str, bool]]:
    """A worked conversation as (text, the model's own) pieces: call, tool result, answer."""
    return [
        (f"tools: calculator\nu: {a}*{b}\na: ", False),
        (call_text(a, b) + "<eos>", True),
        (f"\nr: {a * b}\na: ", False),
        (f"{a * b}<eos>", True),
    ]


@pytest.fixture(scope="module")
def tool_tok(char_tok):
    tok = copy.deepcopy(char_tok)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def caller(tmp_path_factory, tool_tok):
    """A tiny model fitted (SFT on its own turns) to eight conversations that call the calculator."""
    ids, prompt_mask, loss_mask = [], [], []
    for a, b in PAIRS:
        pieces = conversation(a, b)
        rendered = tool_tok.apply_chat_template(
            [
                {"role": "user", "content": f"{a}*{b}"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}},
                        }
                    ],
                },
                {"role": "tool", "content": str(a * b)},
                {"role": "assistant", "content": str(a * b)},
            ],
            tools=TOOLS,
            tokenize=False,
        )
        assert rendered == "".join(t for t, _ in pieces) + "\n"  # the template writes what the model learns
        seq, pm, lm = [], [], []
        for k, (text, own) in enumerate(pieces):
            t = tool_tok(text, add_special_tokens=False)["input_ids"]
            seq += t
            pm += [k == 0] * len(t)
            lm += [own] * len(t)
        ids.append(torch.tensor(seq))
        prompt_mask.append(torch.tensor(pm))
        loss_mask.append(torch.tensor(lm))
    batch = SequenceSample.from_lists(
        list(range(len(PAIRS))),
        {"packed_input_ids": ids, "prompt_mask": prompt_mask, "loss_mask": loss_mask},
    )
    module = tiny_module(tool_tok, seed=0, hidden_size=64, intermediate_size=128, max_position_embeddings=256)
    model = HFBackend(HFBackendArgs(device="cpu", optimizer={"lr": 3e-3})).initialize(
        Model("actor", module, tool_tok), SPEC
    )
    sft = SFTInterface(SFTArgs())
    train_until(lambda: sft.train_step(model, batch, MicroBatchSpec()), lambda s: s["loss"] < 0.01, 200, 800)
    root = tmp_path_factory.mktemp("caller")
    model.module.save_to_hf(tool_tok, str(root / "model"))
    return root / "model"


def parse_tool_calls(text: str, parallel: bool = True):
    return FORMATS["hermes"].parse(text, TOOLS, parallel, lambda k: str(k))


def test_hermes_calls_are_parsed_and_messages_normalized():
    one = '<tool_call>{"name": "calc", "arguments": {"x": "2*3"}}</tool_call>'
    content, calls = parse_tool_calls(one)
    assert content is None and calls == [
        {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"x": "2*3"}'}}
    ]
    two = 'Let me see. <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><tool_call>{"name": "b"}</tool_call>'
    content, calls = parse_tool_calls(two)
    assert content == "Let me see." and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == "{}"
    assert len(parse_tool_calls(two, parallel=False)[1]) == 1
    for text in (
        "no call at all",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
    ):
        assert parse_tool_calls(text) == (text, [])  # not a call: the text stays content

    message = chat_message(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"x": "1"}'}}
            ],
        },
        0,
    )
    assert message == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"x": "1"}}, "id": "c0"}
        ],
    }
    assert chat_message({"role": "tool", "tool_call_id": "c0", "content": "1"}, 1)["tool_call_id"] == "c0"
    with pytest.raises(ProtocolError, match=r"arguments is not JSON"):
        chat_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}, 0)
    with pytest.raises(ProtocolError, match="naming an offered tool"):
        parse_tools(
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, TEMPLATE
        )
    with pytest.raises(ProtocolError, match="must be auto, none, required"):
        parse_tools({"tools": TOOLS, "tool_choice": "always"}, TEMPLATE)
    with pytest.raises(ProtocolError, match="known format .*hermes, llama3_json, mistral"):
        parse_tools({"tools": TOOLS}, "{{ messages }}")
    with pytest.raises(ProtocolError, match="list of"):
        parse_tools({"tools": [{"name": "calc"}]}, TEMPLATE)
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, TEMPLATE) == OfferedTools()
    required = parse_tools({"tools": TOOLS, "tool_choice": "required"}, TEMPLATE)
    assert required.format is FORMATS["hermes"] and required.start == "<tool_call>"
    named = {"type": "function", "function": {"name": "calculator"}}
    assert parse_tools({"tools": TOOLS, "tool_choice": named}, TEMPLATE).start == (
        '<tool_call>\n{"name": "calculator", "arguments": '
    )


@pytest.fixture(scope="module")
def tool_server(caller, tmp_path_factory):
    from arealcli.runtime.clients import launcher
    from tests.test_server import start_servers

    servers = start_servers(caller, tmp_path_factory.mktemp("tool-server-logs"))
    yield servers[0]
    launcher.stop(servers)


def test_function_calling_through_the_openai_client(tool_server, tool_tok):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{tool_server.address}/v1", api_key="unused", max_retries=0)
    for a, b in PAIRS[:3]:
        answer, replies = EXAMPLE.function_calling_agent(client, f"{a}*{b}", temperature=0)
        assert answer == str(a * b) and len(replies) == 2
        first, second = (r.choices[0] for r in replies)
        assert first.finish_reason == "tool_calls" and first.message.content is None
        (call,) = first.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": f"{a}*{b}"}
        prompt = first.model_extra["prompt_token_ids"]
        assert (
            tool_tok.decode(prompt) == f"tools: calculator\nu: {a}*{b}\na: "
        )  # tools rendered by the template
        # the conversation sent back re-renders to exactly the model's tokens, then the tool's turn
        again = second.model_extra["prompt_token_ids"]
        assert (
            again[: len(prompt) + len(first.model_extra["token_ids"])]
            == prompt + first.model_extra["token_ids"]
        )
        assert second.finish_reason == "stop" and not second.message.tool_calls

    # SGLang's /generate stops on texts too (while generating: no token past the one completing it)
    from tests.test_server import post

    prompt = tool_tok("tools: calculator\nu: 12*34\na: ", add_special_tokens=False)["input_ids"]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 80, "temperature": 0, "stop": ["calc"]},
    }
    answer = post(tool_server, "/generate", body).json()
    assert tool_tok.decode(answer["output_ids"]) == '<tool_call>\n{"name": "calc'
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": "calc"}

    plain = client.chat.completions.create(
        model="p",
        messages=[{"role": "user", "content": "12*34"}],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=4,
    )
    assert tool_tok.decode(plain.choices[0].model_extra["prompt_token_ids"]) == "u: 12*34\na: "  # no tools
    # tool_choice required / a named function: the call is started for the model after the generation
    # prompt (the prompt's tokens hold it), and read from the started text and what the model wrote
    a, b = PAIRS[1]
    named = {"type": "function", "function": {"name": "calculator"}}
    for choice, start in (
        ("required", "<tool_call>"),
        (named, '<tool_call>\n{"name": "calculator", "arguments": '),
    ):
        forced = client.chat.completions.create(
            model="p",
            messages=[{"role": "user", "content": f"{a}*{b}"}],
            tools=TOOLS,
            tool_choice=choice,
            temperature=0,
        ).choices[0]
        assert tool_tok.decode(forced.model_extra["prompt_token_ids"]).endswith(f"a: {start}")
        assert forced.finish_reason == "tool_calls" and forced.message.content is None, forced
        (call,) = forced.message.tool_calls
        assert call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": f"{a}*{b}"}
    with pytest.raises(openai.BadRequestError, match="chat/completions"):
        client.completions.create(model="p", prompt="x", extra_body={"tools": TOOLS})


def questions_batch(tok, n: int = 4) -> SequenceSample:
    questions = [f"{a}*{b}" for a, b in PAIRS[:n]]
    prompts = [torch.tensor(tok(q, add_special_tokens=False)["input_ids"]) for q in questions]
    return SequenceSample.from_lists(list(range(n)), {"packed_prompts": prompts})


def generate_with(workflow: dict, actor) -> SequenceSample:
    interface = PPOActorInterface(
        PPOActorArgs.model_validate(
            {"workflow": workflow, "generation": {"greedy": True, "max_new_tokens": 120}, "adv_norm": "none"}
        )
    )
    return interface.generate(actor, questions_batch(actor.tokenizer), MicroBatchSpec())


def test_a_function_calling_agent_generates_training_episodes(caller, tool_tok, tool_server):
    """The same agent code in process (the example's `function_calling_agent` workflow): one trained
    sequence per episode, the call and the answer train, the tool's turn does not; tokens equal those
    served over HTTP (greedy both). The built-in `function_calling` workflow gives the same episodes."""
    openai = pytest.importorskip("openai")
    actor = hf_actor(caller, tool_tok)
    out = generate_with({"type_": "function_calling_agent", "args": {"max_total_tokens": 250}}, actor)
    client = openai.OpenAI(base_url=f"http://{tool_server.address}/v1", api_key="unused", max_retries=0)
    for (a, b), ids, lm, pm in zip(
        PAIRS,
        out.unpack("packed_input_ids"),
        out.unpack("loss_mask"),
        out.unpack("prompt_mask"),
        strict=False,
    ):
        ids, lm = ids.tolist(), lm.bool().tolist()
        parts = [(own, tool_tok.decode(t)) for own, t in segments(ids, lm)]
        assert parts == [
            (own, text) for text, own in conversation(a, b)
        ]  # call and answer train, tool turn not
        assert int(pm.sum()) == len(tool_tok(conversation(a, b)[0][0])["input_ids"])
        _, replies = EXAMPLE.function_calling_agent(client, f"{a}*{b}", temperature=0)
        served = replies[-1].choices[0]
        assert served.model_extra["prompt_token_ids"] + served.model_extra["token_ids"] == ids
    assert out.stats["episode/tool_call_rate"] == 1.0 and out.stats["episode/turns"] == 2

    builtin = generate_with({"type_": "function_calling", "args": {"max_total_tokens": 250}}, actor)
    for key in ("packed_input_ids", "prompt_mask", "loss_mask", "seq_no_eos_mask"):
        assert torch.equal(builtin.data[key], out.data[key]), key
    assert builtin.stats["episode/tool_calls"] == 1.0 and builtin.stats["episode/tool_errors"] == 0.0


def test_a_reply_the_template_renders_otherwise_trains_as_the_model_wrote_it(caller, tool_tok):
    """A template that writes a call's JSON otherwise than the model did (indented): the episode keeps
    the model's own tokens for the call, then the template's text after it — the same episode as with
    a template that renders the call as written."""
    indented = copy.deepcopy(tool_tok)
    indented.chat_template = TEMPLATE.replace("| tojson }}", "| tojson(indent=2) }}")
    assert indented.chat_template != TEMPLATE
    workflow = {"type_": "function_calling", "args": {"max_total_tokens": 250}}
    same = generate_with(workflow, hf_actor(caller, tool_tok))
    other = generate_with(workflow, hf_actor(caller, indented))
    for key in ("packed_input_ids", "prompt_mask", "loss_mask"):
        assert torch.equal(other.data[key], same.data[key]), key
    assert other.stats["episode/tool_call_rate"] == 1.0


def test_function_calling_checks(ws, cli):
    from arealcli.schema.components.workflows import FunctionCallingArgs

    with pytest.raises(ValueError, match="allow_python: true"):
        FunctionCallingArgs(tools=["python"])
    with pytest.raises(ValueError, match="must allow max_turns"):
        FunctionCallingArgs(max_turns=10, max_requests=4)
    with pytest.raises(ValueError, match="did you mean 'calculator'"):
        FunctionCallingArgs(tools=["calculater"])
    import yaml

    from tests.test_agentic import agent_recipe, check_lines

    recipe = yaml.safe_load(agent_recipe(ws).read_text())
    recipe["dataflow"]["actor"]["workflow"] = {"type_": "function_calling"}
    recipe["dataset"]["args"]["apply_chat_template"] = True
    lines = check_lines(cli, ws.text("fc.yaml", yaml.safe_dump(recipe, sort_keys=False)))
    assert any("tokenizer: the function_calling workflow needs a chat template" in x for x in lines)
    assert any("dataset.args.apply_chat_template: " in x and "plain questions" in x for x in lines)
    recipe["tokenizer"]["chat_template"] = TEMPLATE
    del recipe["dataset"]["args"]["apply_chat_template"]
    assert cli("check", ws.text("fc.yaml", yaml.safe_dump(recipe, sort_keys=False))).exit_code == 0

    from arealcli.runtime.tools import tool_schema

    assert tool_schema("python")["function"]["parameters"]["required"] == ["code"]
    assert tool_schema("calculator")["function"]["parameters"]["properties"] == {
        "expression": {"type": "string"}
    }


def test_stop_texts_of_several_tokens_end_generation_on_every_engine(caller, tool_tok):
    """`generation.stop`: the sample keeps the tokens up to the one completing the text (no_eos False),
    on the training engine (cut after generation) and the local inference engine (stopped while
    generating); the kept tokens and log-probs are those of a run without the stop."""
    from transformers import AutoModelForCausalLM

    from arealcli.runtime.backends.local import LocalBackend
    from arealcli.schema.components.backends import LocalBackendArgs
    from arealcli.schema.components.engine import GenerationHyperparameters

    prompt = tool_tok("tools: calculator\nu: 417*38\na: ", add_special_tokens=False)["input_ids"]
    batch = SequenceSample.from_lists([0, 1], {"packed_prompts": [torch.tensor(prompt)] * 2})
    plain = GenerationHyperparameters(greedy=True, max_new_tokens=120)
    stopped = plain.model_copy(update={"stop": ['"arguments"', "never"]})
    hf = hf_actor(caller, tool_tok)
    full = hf.module.generate(batch, MicroBatchSpec(), tool_tok, plain)
    assert tool_tok.decode(full.output_ids[0]) == call_text(417, 38) + "<eos>"
    module = AutoModelForCausalLM.from_pretrained(caller, dtype=torch.float32)
    local = LocalBackend(LocalBackendArgs()).initialize(Model("gen", module, tool_tok), SPEC)
    try:
        for engine in (hf.module, local.module):
            out = engine.generate(batch, MicroBatchSpec(), tool_tok, stopped)
            for ids, lps, no_eos in zip(out.output_ids, out.logprobs, out.no_eos, strict=True):
                assert (
                    tool_tok.decode(ids) == '<tool_call>\n{"name": "calculator", "arguments"' and not no_eos
                )
                assert ids == full.output_ids[0][: len(ids)]
                assert lps == pytest.approx(full.logprobs[0][: len(ids)], abs=1e-4)
    finally:
        local.module.close()


def test_tool_use_with_multi_token_tags(caller, tool_tok):
    """The tool_use workflow with Hermes tags that are many tokens each (generation stops on the text)."""
    actor = hf_actor(caller, tool_tok)
    prompts = [
        tool_tok(f"tools: calculator\nu: {a}*{b}\na: ", add_special_tokens=False)["input_ids"]
        for a, b in PAIRS[:3]
    ]
    batch = SequenceSample.from_lists([0, 1, 2], {"packed_prompts": [torch.tensor(p) for p in prompts]})
    workflow = {
        "type_": "tool_use",
        "args": {
            "tools": ["calculator"],
            "call_open": "<tool_call>",
            "call_close": "</tool_call>",
            "result_template": "<eos>\nr: {result}\na: ",
            "max_total_tokens": 200,
        },
    }
    interface = PPOActorInterface(
        PPOActorArgs.model_validate(
            {"workflow": workflow, "generation": {"greedy": True, "max_new_tokens": 120}, "adv_norm": "none"}
        )
    )
    out = interface.generate(actor, batch, MicroBatchSpec())
    for (a, b), ids, lm, p in zip(
        PAIRS, out.unpack("packed_input_ids"), out.unpack("loss_mask"), prompts, strict=False
    ):
        parts = [
            (own, tool_tok.decode(t))
            for own, t in segments(ids.tolist()[len(p) :], lm.bool().tolist()[len(p) :])
        ]
        assert parts == [(True, call_text(a, b)), (False, f"<eos>\nr: {a * b}\na: "), (True, f"{a * b}<eos>")]
    assert out.stats["episode/tool_call_rate"] == 1.0 and out.stats["episode/tool_errors"] == 0


def fc_rows(pairs) -> list[dict]:
    """Worked function-calling episodes in OpenAI messages (the SFT warm-up of a function_calling run)."""
    return [
        {
            "prompt": f"{a}*{b}",
            "answer": str(a * b),
            "episode": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_0",
                            "type": "function",
                            "function": {
                                "name": "calculator",
                                "arguments": json.dumps({"expression": f"{a}*{b}"}),
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)},
                {"role": "assistant", "content": str(a * b)},
            ],
        }
        for a, b in pairs
    ]


def test_warm_up_episodes_are_what_the_function_calling_workflow_generates(caller, tool_tok, tmp_path):
    """`episode_tools`: a worked episode renders to the very tokens the workflow's episode has (plus the
    template's newline after the last turn); the loss is on the model's replies; the prompt for
    generation stays the plain question."""
    from arealcli.errors import DataError
    from arealcli.runtime.data.datasets import PromptAnswerDataset
    from arealcli.schema.components.datasets import PromptAnswerArgs
    from tests.conftest import write_jsonl

    write_jsonl(tmp_path / "fc.jsonl", fc_rows(PAIRS[:4]))
    args = PromptAnswerArgs(
        path="fc.jsonl", episode_key="episode", episode_tools=["calculator"], max_length=256
    )
    data = PromptAnswerDataset(args, tool_tok, tmp_path).collate([0, 1, 2, 3])
    rl = generate_with(
        {"type_": "function_calling", "args": {"max_total_tokens": 250}}, hf_actor(caller, tool_tok)
    )
    newline = tool_tok("\n", add_special_tokens=False)["input_ids"]
    for (a, b), sft_ids, sft_mask, pm, prompt, ids, mask in zip(
        PAIRS,
        data.unpack("packed_input_ids"),
        data.unpack("loss_mask"),
        data.unpack("prompt_mask"),
        data.unpack("packed_prompts"),
        rl.unpack("packed_input_ids"),
        rl.unpack("loss_mask"),
        strict=False,
    ):
        assert tool_tok.decode(prompt) == f"{a}*{b}"  # what the workflow gets
        assert sft_ids.tolist() == ids.tolist() + newline
        assert tool_tok.decode(sft_ids[pm]) == f"tools: calculator\nu: {a}*{b}\na: "
        extra = sft_mask[: len(mask)] & ~mask.bool()  # SFT also learns the template's newline after <eos>
        assert (mask.bool() <= sft_mask[: len(mask)]).all() and set(
            tool_tok.decode(sft_ids[: len(mask)][extra])
        ) == {"\n"}

    bad = fc_rows(PAIRS[:1])
    bad[0]["episode"][0]["tool_calls"][0]["function"]["arguments"] = "{oops"
    write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(DataError, match=r"bad.jsonl:1: 'episode': .*arguments is not JSON"):
        PromptAnswerDataset(args.model_copy(update={"path": "bad.jsonl"}), tool_tok, tmp_path)
    with pytest.raises(ValueError, match="set episode_key too"):
        PromptAnswerArgs(path="x.jsonl", episode_tools=["calculator"])


def test_stop_texts_find_the_token_that_completes_a_text(tool_tok):
    from arealcli.runtime.generation.sampling import GenerationResult, StopTexts

    def ids(text: str) -> list[int]:
        return tool_tok(text, add_special_tokens=False)["input_ids"]

    texts = StopTexts(["</x>", "ab "], lambda t: tool_tok.decode(t, skip_special_tokens=True))
    assert texts.first_end(ids("hello")) is None
    assert texts.first_end(ids("hi</x>")) == 6  # the last token completes it
    assert texts.first_end(ids("hi</x>more</x>")) == 6  # the first completion, mid-sample
    assert texts.first_end(ids("xxab yy")) == 5  # a text ending in a space (no pre-filter)
    assert texts.matched(ids("hi</x>")) == "</x>" and texts.matched(ids("hi</")) is None
    only = StopTexts(["</x>"], texts.decode)
    assert not only.may_end(ids("a")[0]) and only.may_end(ids(">")[0])
    result = GenerationResult([ids("a</x>bc"), ids("abc")], [[0.1] * 7, [0.2] * 3], [True, True])
    cut = only.cut(result)
    assert cut.output_ids[0] == ids("a</x>") and cut.logprobs[0] == [0.1] * 5 and cut.no_eos == [False, True]
