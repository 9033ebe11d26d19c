"""Tool-call formats (runtime/wire/tool_calls.py): each found from a chat template written in its model
family's style, and a call rendered by that template read back as the same OpenAI tool call."""

from __future__ import annotations

import copy
import json

import pytest

from arealcli.runtime.wire.openai import ProtocolError, parse_tools
from arealcli.runtime.wire.tool_calls import FORMATS, format_of

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "b": {"type": "integer"},
                    "note": {"type": "string"},
                },
            },
        },
    }
]
ARGS = {"a": 12, "b": 30, "note": "12"}  # a string that reads as a number stays a string

_TURNS = (
    "{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}\n"
    "{% elif m.role == 'assistant' %}A:{{ m.content or '' }}{CALLS}<eos>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
# One template per format, each writing calls as its model family's template does (and carrying the text
# by which the format is recognized); tools are listed as JSON before the conversation.
TEMPLATES = {
    "hermes": "<tools>{{ tools | tojson }}</tools>\n"
    + _TURNS.replace(
        "{CALLS}",
        "{% for c in m.tool_calls or [] %}\n<tool_call>\n"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
        "{% endfor %}",
    ),
    "llama3_json": "Given the following functions, please respond with a JSON for a function call with its "
    'proper arguments. Respond in the format {"name": function name, "parameters": dictionary}. '
    "{{ tools | tojson }}\n"
    + _TURNS.replace(
        "{CALLS}",
        "{% for c in m.tool_calls or [] %}"
        '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
        "{% if not loop.last %}; {% endif %}{% endfor %}",
    ),
    "mistral": "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]\n"
    + _TURNS.replace(
        "{CALLS}",
        "{% if m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
        '"id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{% endif %}',
    ),
    "qwen3_coder": "<tools>{% for t in tools %}<function><name>{{ t.function.name }}</name></function>"
    "{% endfor %}</tools> Call: <tool_call>\n<function=name>\n<parameter=x>\nvalue\n</parameter>\n"
    "</function>\n</tool_call>\n"
    + _TURNS.replace(
        "{CALLS}",
        "{% for c in m.tool_calls or [] %}\n<tool_call>\n<function={{ c.function.name }}>\n"
        "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n"
        "{% if v is string %}{{ v }}{% else %}{{ v | tojson }}{% endif %}\n</parameter>\n{% endfor %}"
        "</function>\n</tool_call>{% endfor %}",
    ),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_call_rendered_by_the_template_reads_back_as_the_same_call(name, char_tok):
    tok = copy.deepcopy(char_tok)
    tok.chat_template = TEMPLATES[name]
    form = format_of(tok.chat_template)
    assert form is FORMATS[name]
    calls = [
        {"id": "abcdefghi", "type": "function", "function": {"name": "add", "arguments": ARGS}},
        {"id": "jklmnopqr", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
    ]
    messages = [{"role": "user", "content": "12+30?"}]
    head = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    messages.append(
        {"role": "assistant", "content": "Adding." if name != "llama3_json" else "", "tool_calls": calls}
    )
    whole = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert whole.startswith(head)
    reply = whole[len(head) :].removesuffix("<eos>\n")  # what the model wrote (its end token dropped)

    content, parsed = form.parse(reply, TOOLS, serial=lambda k: f"s{k}")
    assert content == ("Adding." if name != "llama3_json" else None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
        ("add", ARGS),
        ("add", {"a": 1, "b": 2}),
    ]
    assert len({c["id"] for c in parsed}) == 2
    if name == "mistral":  # its templates take ids of nine letters and digits
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in parsed)
    assert len(form.parse(reply, TOOLS, parallel=False)[1]) == 1
    assert form.parse("12+30 is 42", TOOLS) == ("12+30 is 42", [])  # text: no call

    # tool_choice: the start of a call, after the generation prompt; the call the model then completes
    named = {"type": "function", "function": {"name": "add"}}
    start = parse_tools({"tools": TOOLS, "tool_choice": named}, tok.chat_template).start
    body = json.dumps(ARGS) + ("}]" if name == "mistral" else "}")
    if name == "qwen3_coder":
        body = "<parameter=a>\n12\n</parameter>\n<parameter=b>\n30\n</parameter>\n<parameter=note>\n12\n</parameter>\n"
        body += "</function>\n</tool_call>"
    _, (call,) = form.parse(start + body, TOOLS)
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == ARGS
    assert parse_tools({"tools": TOOLS, "tool_choice": "required"}, tok.chat_template).start == form.opening


def test_a_malformed_call_stays_text_and_an_unknown_template_or_format_is_refused():
    for name, text in (
        ("llama3_json", '{"name": "add", "parameters": {"a": 1}'),  # cut short
        ("mistral", "[TOOL_CALLS]not json"),
        ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>"),
        ("hermes", '<tool_call>{"name": 1}</tool_call>'),
    ):
        assert FORMATS[name].parse(text, TOOLS) == (text, []), name
    with pytest.raises(ProtocolError, match="known format"):
        parse_tools({"tools": TOOLS}, "{{ messages }}")
    assert parse_tools({"tools": TOOLS}, "{{ messages }}", "mistral").format is FORMATS["mistral"]


def test_areal_serve_refuses_an_unknown_tool_call_parser(tmp_path):
    from arealcli.errors import UserError
    from arealcli.runtime.serve.start import ServeFlags, refuse

    (tmp_path / "config.json").write_text("{}")
    flags = ServeFlags(
        tmp_path,
        "127.0.0.1",
        0,
        "cpu",
        "float32",
        5.0,
        8,
        4,
        16,
        8,
        8,
        None,
        None,
        False,
        "v",
        0,
        False,
        [],
        "xml",
    )
    with pytest.raises(UserError, match="--tool-call-parser xml: not a known format"):
        refuse(flags)
