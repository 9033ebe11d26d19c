"""OpenAI-compatible requests and responses for `areal serve`: agent code written for the OpenAI API can
be pointed at a policy while it trains.

    POST /v1/completions        {prompt: str | [int] | [str] | [[int]], max_tokens=16, temperature=1,
                                 top_p, n, stop, logprobs (0), ...}
    POST /v1/chat/completions   {messages: [{role, content, tool_calls?, tool_call_id?}], tools?,
                                 tool_choice?, max_tokens | max_completion_tokens, temperature, top_p,
                                 n, stop, logprobs (bool), ...}
    GET  /v1/models

Chat prompts are rendered with the served tokenizer's chat template (its generation prompt appended).
Function calling: `tools` are rendered by the chat template; calls the model writes in the Hermes format
that Qwen2.5/Qwen3 and Hermes templates teach, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
come back as `message.tool_calls` (arguments as a JSON text) with finish_reason "tool_calls", and the
text before the first call as `content`. Assistant messages with `tool_calls` and `tool` messages are
passed to the template with the arguments as objects (as Hugging Face templates expect).
As with OpenAI, a matched `stop` text is not part of the returned text; `stop_reason` (vLLM's field)
says which stop text or stop token id ended a choice (None: the end-of-sequence token).
Every choice also carries `token_ids` (the generated tokens) and `prompt_token_ids`, and a response its
policy version that generated it (the first and the last when a weight update
interrupted it: aborted samples are continued on the new weights, never cut) in `weight_version` and
`weight_version_last`. Beyond OpenAI's fields,
vLLM's `top_k`, `min_tokens` and `stop_token_ids` are accepted. What the embedded server cannot do
(streaming, forced tool calls, penalties, top alternatives of log-probs) is
refused with a message saying so, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, overload

from arealcli.runtime.wire.sglang import ProtocolError, Sampling

# Fields accepted only at their neutral values (None and these).
_NEUTRAL: dict[str, tuple] = {
    "stream": (False,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "seed": (),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (False, True),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "stream_options": (),
}
_WHY = {
    "tools": "tools are offered through /v1/chat/completions (`tools`, with `tool_choice` auto or none)",
    "seed": "the embedded server has no per-request seed",
    "stream": "the embedded server answers whole responses only",
}
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "return_token_ids", "skip_special_tokens"}
_COMMON = {"max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "min_tokens"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class OpenAIRequest:
    prompts: list[list[int] | str]  # token ids, or text to encode
    sampling: Sampling
    logprobs: bool
    chat: bool
    stop_texts: tuple[str, ...]  # `stop`
    stop_ids: tuple[int, ...]  # `stop_token_ids`
    tools: list[dict] | None = None  # offered tools: parse the model's calls
    parallel_tool_calls: bool = True


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise ProtocolError(f"{key} must be a number in [{lo:g}, {hi:g}] (got {v!r})")
    return float(v)


@overload
def _integer(body: dict, key: str, default: int, lo: int) -> int: ...
@overload
def _integer(body: dict, key: str, default: None, lo: int) -> int | None: ...
def _integer(body: dict, key: str, default: int | None, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ProtocolError(f"{key} must be an integer >= {lo} (got {v!r})")
    return v


def _check_fields(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if key in allowed:
            continue
        if value is not None and value not in neutral:
            why = _WHY.get(key.removesuffix("_choice").replace("functions", "tools"), "")
            raise ProtocolError(
                f"{key}={value!r} is not supported by the embedded server" + (f": {why}" if why else "")
            )
    unknown = sorted(set(body) - allowed - set(_NEUTRAL) - _IGNORED)
    if unknown:
        raise ProtocolError(f"unknown fields {unknown}")
    return body


def _stops(body: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`stop` texts and `stop_token_ids`."""
    stop = body.get("stop")
    texts = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(texts, list) or not all(isinstance(s, str) and s for s in texts) or len(texts) > 4:
        raise ProtocolError(f"stop must be a text or a list of up to 4 texts (got {stop!r})")
    extra = body.get("stop_token_ids") or []
    if not isinstance(extra, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in extra):
        raise ProtocolError(f"stop_token_ids must be a list of integers (got {extra!r})")
    return tuple(dict.fromkeys(texts)), tuple(extra)


def finish_of(
    ids: list[int], finished: str, decode, stop_texts: tuple[str, ...], stop_ids
) -> tuple[str, Any, str]:
    """(finish_reason, stop_reason, text): as OpenAI, a matched `stop` text and what follows it are not
    part of the returned text (the tokens stay in `token_ids`: the model generated them); `stop_reason`
    (vLLM's field) is the matched stop text or stop token id, None at the end-of-sequence token or a
    length cut. `decode(ids)` skips special tokens."""
    text = decode(ids)
    if finished != "stop" or not ids:
        return "length", None, text
    hits = [(text.find(t), t) for t in stop_texts if t in text]
    if hits:
        at, matched = min(hits)
        return "stop", matched, text[:at]
    return "stop", ids[-1] if ids[-1] in stop_ids else None, text


def _sampling(body: dict, max_tokens: int | None, stops: tuple[tuple[str, ...], tuple[int, ...]]) -> Sampling:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_k = _integer(body, "top_k", -1, -1)
    if top_k == 0:
        raise ProtocolError("top_k must be -1 (all tokens) or at least 1 (got 0)")
    min_tokens = _integer(body, "min_tokens", 0, 0)
    return Sampling(
        max_new_tokens=max_tokens if max_tokens is not None else 1 << 30,  # the context length caps it
        min_new_tokens=min_tokens if max_tokens is None else min(min_tokens, max_tokens),
        temperature=temperature,
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=max(top_k, 0),
        stop_token_ids=tuple(sorted(set(stops[1]))),
        stop=stops[0],
        n=_integer(body, "n", 1, 1),
    )


def parse_completion_request(body: Any) -> OpenAIRequest:
    body = _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt)
    ):
        prompts = list(prompt)
    else:
        raise ProtocolError("prompt must be a text, a list of token ids, or a list of those (non-empty)")
    if any(p == "" for p in prompts):
        raise ProtocolError("prompt must not be empty")
    logprobs = _integer(body, "logprobs", None, 0)
    if logprobs is not None and logprobs > 0:
        raise ProtocolError(
            "logprobs > 0 (top alternatives) is not supported by the embedded server; "
            "logprobs: 0 returns the log-prob of every generated token"
        )
    max_tokens = _integer(body, "max_tokens", 16, 0)  # OpenAI's default for completions
    stops = _stops(body)
    return OpenAIRequest(prompts, _sampling(body, max_tokens, stops), logprobs is not None, False, *stops)


def _as_dict(obj: Any) -> Any:
    """A message or tool call given as an object (the client's own response objects) as a dict."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    dump = getattr(obj, "model_dump", None)  # the openai package's pydantic objects
    return dump(exclude_none=True) if callable(dump) else obj


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call ({id, type: function, function: {name, arguments: JSON text}}) as templates
    take it: arguments as an object."""
    call = _as_dict(call)
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ProtocolError(f"{where} must be {{type: function, function: {{name, arguments}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ProtocolError(f"{where}.function.arguments is not JSON (got {args!r})") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def chat_message(message: Any, i: int) -> dict[str, Any]:
    """One OpenAI message as chat templates take it: text content (text parts joined), an assistant's
    `tool_calls` with their arguments as objects, a tool message's `tool_call_id` and `name`."""
    message = _as_dict(message)
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ProtocolError(f"messages[{i}] must be an object with a role and a content")
    content = message.get("content")
    if isinstance(content, list):  # [{type: text, text}] parts
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise ProtocolError(f"messages[{i}].content: only text parts are supported")
        content = "".join(p["text"] for p in content)
    calls = message.get("tool_calls") or []
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise ProtocolError(f"messages[{i}].content must be a text (got {type(content).__name__})")
    out: dict[str, Any] = {"role": message["role"], "content": content}
    if calls:
        if message["role"] != "assistant" or not isinstance(calls, list):
            raise ProtocolError(
                f"messages[{i}].tool_calls: only an assistant message has a list of tool calls"
            )
        out["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def parse_tools(body: dict, template: str | None) -> tuple[list[dict] | None, bool]:
    """The offered tools when the model may call them (tool_choice auto), else None; and whether
    several calls may come back (parallel_tool_calls)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError(f"parallel_tool_calls must be true or false (got {parallel!r})")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ProtocolError(f"tool_choice={choice!r} needs tools")
        return None, parallel is not False
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise ProtocolError(
            "tools must be a list of {type: function, function: {name, description, parameters}}"
        )
    if choice == "none":
        return None, parallel is not False  # as vLLM: the tools stay out of the prompt
    if choice not in (None, "auto"):
        raise ProtocolError(
            f"tool_choice={choice!r} is not supported: forcing a call needs constrained decoding; "
            "use auto (the model decides) or none"
        )
    if TOOL_OPEN not in str(template or ""):
        raise ProtocolError(
            "tools need a chat template that writes Hermes-style calls "
            f"({TOOL_OPEN}{{...}}{TOOL_CLOSE}, as Qwen2.5, Qwen3 and Hermes models do); the served one does not"
        )
    return tools, parallel is not False


_CALL = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CLOSE), re.S)


def parse_tool_calls(text: str, ids: list[str], parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a generated text: Hermes-style `<tool_call>{"name", "arguments"}</tool_call>`
    blocks become OpenAI tool calls (arguments as a JSON text; `ids` names them), the text before the
    first call the content (trailing whitespace dropped; None when blank). A block that is not such JSON leaves the whole text as
    content with no calls (as vLLM's hermes parser does)."""
    calls = []
    for k, m in enumerate(_CALL.finditer(text)):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": ids[k] if k < len(ids) else f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    if not calls:
        return text, []
    # the text before the first call, without the whitespace that separates it from the call (templates
    # such as Qwen2.5's put their own newline there when they render the message back)
    content = text[: text.index(TOOL_OPEN)].rstrip()
    return (content or None), calls if parallel else calls[:1]


def parse_chat_request(body: Any, render, template: str | None) -> OpenAIRequest:
    """`render(messages, tools) -> token ids` applies the served tokenizer's chat template (`template`)."""
    body = _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list of {role, content}")
    tools, parallel = parse_tools(body, template)
    prompt = render([chat_message(m, i) for i, m in enumerate(messages)], tools)
    top = _integer(body, "top_logprobs", None, 0)
    if top:
        raise ProtocolError(
            "top_logprobs > 0 is not supported by the embedded server (logprobs: true gives each token's)"
        )
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ProtocolError(f"logprobs must be true or false (got {logprobs!r})")
    max_tokens = _integer(body, "max_completion_tokens", None, 0)
    max_tokens = _integer(body, "max_tokens", None, 0) if max_tokens is None else max_tokens
    stops = _stops(body)
    return OpenAIRequest(
        [prompt], _sampling(body, max_tokens, stops), bool(logprobs), True, *stops, tools, parallel
    )


@dataclass
class Choice:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish: str  # stop | length
    stop_reason: Any  # the matched stop text or stop token id; None otherwise
    text: str
    token_texts: list[str]  # each token's text (only when log-probs were asked for)
    versions: list[str]  # weight versions that generated it (first ... last)


def completion_response(
    req: OpenAIRequest, choices: list[Choice], model: str, prompt_tokens: int
) -> dict[str, Any]:
    created = int(time.time())
    out = []
    for i, c in enumerate(choices):
        item: dict[str, Any] = {
            "index": i,
            "finish_reason": c.finish,
            "stop_reason": c.stop_reason,
            "token_ids": c.output_ids,
            "prompt_token_ids": c.prompt_ids,
            # the policy versions that generated it: they differ when a weight update interrupted it
            "weight_version": c.versions[0],
            "weight_version_last": c.versions[-1],
        }
        if req.chat:
            item["message"] = {"role": "assistant", "content": c.text}
            if req.tools:
                ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in range(c.text.count(TOOL_OPEN))]
                content, calls = parse_tool_calls(c.text, ids, req.parallel_tool_calls)
                if calls:
                    item["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    item["finish_reason"] = "tool_calls" if c.finish == "stop" else c.finish
            item["logprobs"] = (
                {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(c.token_texts, c.logprobs, strict=True)
                    ]
                }
                if req.logprobs
                else None
            )
        else:
            item["text"] = c.text
            offsets, at = [], 0
            for t in c.token_texts:  # (token texts are there when log-probs were asked for)
                offsets.append(at)
                at += len(t)
            item["logprobs"] = (
                {
                    "tokens": c.token_texts,
                    "token_logprobs": c.logprobs,
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
                if req.logprobs
                else None
            )
        out.append(item)
    generated = sum(len(c.output_ids) for c in choices)
    return {
        "id": f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        },
    }


def models_response(model: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "arealcli"}],
    }
