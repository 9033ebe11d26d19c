"""Tool calls in the formats models write, read back as OpenAI tool calls.

A chat template teaches its model one way to write a call. The server offers `tools` through the template
and reads the reply in the same format:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>      Qwen2.5, Qwen3, Hermes
    llama3_json  {"name": "f", "parameters": {...}}, the whole reply (after an optional <|python_tag|>;
                 several calls separated by ";")                            Llama 3.1, 3.2, 3.3
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]        Mistral v0.3, Nemo, Small
                 or [TOOL_CALLS]f[ARGS]{...} for each call (newer templates)
    qwen3_coder  <tool_call><function=f><parameter=x>value</parameter></function></tool_call> (each tag
                 on its own line; a value is text, read as JSON when the tool's schema says it is not a
                 string)                                                    Qwen3-Coder

The format is found from the template's text (each leaves its mark there) or named (`areal serve
--tool-call-parser NAME`). Text before the first call is the message's content (the last call may be left
open: the model ended there); a reply whose calls do
not parse is content with no calls (as vLLM's parsers). Calls are read from the reply decoded with its
special tokens (`[TOOL_CALLS]` and `<|python_tag|>` are special tokens of their vocabularies).

`tool_choice` "required" and a named function are met by starting the call for the model: the format's
opening (and the function's name) is put after the generation prompt, and the model writes the rest. It
is a prefix, not constrained decoding: a model that does not finish the call gives text, not a call.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Calls = tuple[str | None, list[dict[str, Any]]]


def _call(name: str, args: Any, call_id: str) -> dict[str, Any]:
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _named(obj: Any) -> tuple[str, Any] | None:
    """(name, arguments) of a {"name", "arguments" | "parameters"} object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return (obj["name"], args) if isinstance(args, dict | str) else None


def _json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values of `text`, one after another, with `separators` (and blanks) between them; None
    when some part is not JSON."""
    decoder, values, at = json.JSONDecoder(), list[Any](), 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _content(text: str, at: int) -> str | None:
    """The text before a call, without the blanks that separate it from the call."""
    return text[:at].rstrip() or None


# a call between <tool_call> and </tool_call>, or the last one left open (the model ended there)
_CALLS = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)


def _hermes(text: str, tools: list[dict], new_id: Callable[[], str]) -> Calls:
    found = list(_CALLS.finditer(text))
    calls = []
    for m in found:
        values = _json_values(m.group(1), "")
        named = _named(values[0]) if values and len(values) == 1 else None
        if named is None:
            return text, []
        calls.append(_call(*named, new_id()))
    return (_content(text, found[0].start()), calls) if calls else (text, [])


def _llama3_json(text: str, tools: list[dict], new_id: Callable[[], str]) -> Calls:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    values = _json_values(body, ";")
    named = [_named(v) for v in values or []]
    if not named or any(n is None for n in named):
        return text, []
    return None, [_call(*n, new_id()) for n in named if n is not None]


def _mistral(text: str, tools: list[dict], new_id: Callable[[], str]) -> Calls:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return text, []
    calls = []
    for part in text[at:].split("[TOOL_CALLS]")[1:]:
        part = part.strip()
        if part.startswith("["):  # a JSON list of {name, arguments}
            values = _json_values(part, "")
            items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
            named = [_named(v) for v in items or []]
            if not named or any(n is None for n in named):
                return text, []
            calls += [_call(*n, new_id()) for n in named if n is not None]
        elif "[ARGS]" in part:  # name[ARGS]{arguments}
            name, args = part.split("[ARGS]", 1)
            values = _json_values(args, "")
            if not name.strip() or not values or len(values) != 1 or not isinstance(values[0], dict):
                return text, []
            calls.append(_call(name.strip(), values[0], new_id()))
        else:
            return text, []
    return _content(text, at), calls


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: kept as text for strings (or no schema), else JSON."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _qwen3_coder(text: str, tools: list[dict], new_id: Callable[[], str]) -> Calls:
    found = list(_CALLS.finditer(text))
    schemas = {
        t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {} for t in tools
    }
    calls = []
    for m in found:
        function = _FUNCTION.fullmatch(m.group(1).strip())
        if function is None:
            return text, []
        name, body = function.group(1), function.group(2)
        props = schemas.get(name, {})
        args = {p.group(1): _typed(p.group(2), props.get(p.group(1))) for p in _PARAMETER.finditer(body)}
        calls.append(_call(name, args, new_id()))
    return (_content(text, found[0].start()), calls) if calls else (text, [])


def _openai_id(serial: str) -> str:
    return f"call_{serial}"


def _mistral_id(serial: str) -> str:
    """Mistral's templates take tool call ids of nine letters and digits."""
    return hashlib.sha1(serial.encode()).hexdigest()[:9]


@dataclass(frozen=True)
class ToolFormat:
    """One way of writing tool calls: how to find it in a template, read it, and start a call."""

    name: str
    marks: tuple[str, ...]  # all in a chat template that teaches this format
    parse_calls: Callable[[str, list[dict], Callable[[], str]], Calls]
    opening: str  # what a call starts with (tool_choice required)
    named: str  # the start of a call to one function ({name}: tool_choice names it)
    visible: str | None  # where a call starts in the plain text, when no special token hides it
    call_id: Callable[[str], str] = _openai_id

    def parse(
        self, text: str, tools: list[dict], parallel: bool = True, serial: Callable[[int], str] | None = None
    ) -> Calls:
        """(content, calls): the calls as OpenAI tool calls (arguments as a JSON text), only the first
        without `parallel`; the whole text as content and no calls when there is no call or it does not
        parse. Call k's id is made from `serial(k)` (default: random)."""
        serial = serial or (lambda k: uuid.uuid4().hex[:24])
        counter = iter(range(1 << 30))
        content, calls = self.parse_calls(text, tools, lambda: self.call_id(serial(next(counter))))
        return content, calls if parallel else calls[:1]

    def start(self, choice: Any) -> str:
        """The text that starts a call for the model under this `tool_choice` ("" when it decides)."""
        if choice == "required":
            return self.opening
        if isinstance(choice, dict):
            return self.named.format(name=choice["function"]["name"])
        return ""


FORMATS = {
    f.name: f
    for f in (
        # checked in this order: a qwen3_coder template has <tool_call> too
        ToolFormat(
            "qwen3_coder",
            ("<function=", "<parameter="),
            _qwen3_coder,
            "<tool_call>\n<function=",
            "<tool_call>\n<function={name}>\n",
            "<tool_call>",
        ),
        ToolFormat(
            "hermes",
            ("<tool_call>",),
            _hermes,
            "<tool_call>",
            '<tool_call>\n{{"name": "{name}", "arguments": ',
            "<tool_call>",
        ),
        ToolFormat(
            "mistral",
            ("[TOOL_CALLS]",),
            _mistral,
            "[TOOL_CALLS]",
            '[TOOL_CALLS][{{"name": "{name}", "arguments": ',
            None,
            _mistral_id,
        ),
        ToolFormat(
            "llama3_json",
            ("respond with a JSON for a function call",),
            _llama3_json,
            '{"name": "',
            '{{"name": "{name}", "parameters": ',
            None,
        ),
    )
}


def format_of(template: str | None, name: str | None = None) -> ToolFormat | None:
    """The tool-call format named, or the one whose marks the chat template has (None: no known one)."""
    if name is not None:
        return FORMATS[name]
    text = str(template or "")
    return next((f for f in FORMATS.values() if all(m in text for m in f.marks)), None)


def call_text(ids: list[int], start: str, decode, decode_raw) -> str:
    """The reply as calls are read from it: the start written for the model, then the generated tokens
    with their special tokens (`decode_raw`), less a special token that ended them (EOS, end of turn:
    `decode`, which skips special tokens, gives it no text)."""
    if ids and not decode(ids[-1:]):
        ids = ids[:-1]
    return start + decode_raw(ids)
