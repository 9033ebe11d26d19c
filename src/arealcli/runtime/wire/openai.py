"""OpenAI-compatible requests and responses for `areal serve`: agent code written for the OpenAI API can
be pointed at a policy while it trains.

    POST /v1/completions        {prompt: str | [int] | [str] | [[int]], max_tokens=16, temperature=1,
                                 top_p, n, stop, logprobs (0..20), echo, stream, stream_options, ...}
    POST /v1/chat/completions   {messages: [{role, content, tool_calls?, tool_call_id?}], tools?,
                                 tool_choice?, max_tokens | max_completion_tokens, temperature, top_p,
                                 n, stop, logprobs (bool), top_logprobs (0..20), stream, stream_options, ...}
    GET  /v1/models

Chat prompts are rendered with the served tokenizer's chat template (its generation prompt appended).
Function calling: `tools` are rendered by the chat template; calls the model writes in its template's
format (Hermes `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`, Qwen3-Coder XML: `tool_calls.py`)
come back as `message.tool_calls` (arguments as a JSON text) with finish_reason "tool_calls", and the
text before the first call as `content`; `tool_choice` auto, none, required or a named function (the
call started for the model). Assistant messages with `tool_calls` and `tool` messages are passed to the
template with the arguments as objects (as Hugging Face templates expect).
As with OpenAI, a matched `stop` text is not part of the returned text; `stop_reason` (vLLM's field)
says which stop text or stop token id ended a choice (None: the end-of-sequence token).
Every choice also carries `token_ids` (the generated tokens) and `prompt_token_ids`, and a response its
policy version that generated it (the first and the last when a weight update
interrupted it: aborted samples are continued on the new weights, never cut) in `weight_version` and
`weight_version_last`. Beyond OpenAI's fields,
vLLM's `top_k`, `min_tokens`, `stop_token_ids` and `ignore_eos` (as `min_tokens` = `max_tokens`: EOS is
never drawn) are accepted.

Log-probs: completions' `logprobs: N` gives each token's log-prob (`token_logprobs`), its text
(`tokens`, `text_offset`) and, for N > 0, `top_logprobs`: the N most likely tokens at each position as
{text: log-prob}, best first, with the chosen token added when it is not among them (as OpenAI and vLLM).
Chat's `logprobs: true` gives `logprobs.content` [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}] with `top_logprobs: N` alternatives. A generated token's log-probs are those of the distribution
it was drawn from (temperature, top-k, top-p applied; greedy: the model's own). `echo: true` (completions)
puts the prompt before the generated text, and with `logprobs` the prompt's tokens before the generated
ones (the first one's log-prob and alternatives null: nothing predicts it): the model's own log-probs,
from one forward pass over the prompt. With `max_tokens: 0` only the prompt is scored (the log-likelihood
requests of lm-evaluation-harness: `echo: true, logprobs: 1, max_tokens: 0|1`). `seed` is accepted where
it changes nothing (greedy, or nothing generated).

Streaming (`stream: true`): server-sent events `data: {chunk}` and a last `data: [DONE]`, in OpenAI's
chunk format ("text_completion" with `text`; "chat.completion.chunk" with `delta`), each choice's tokens
in `token_ids` (its prompt's in `prompt_token_ids` of its first chunk) and, when asked, its log-probs;
`finish_reason` (and `stop_reason`, `weight_version`) in the last chunk of each choice, then with
`stream_options: {include_usage: true}` a chunk with `usage` and no choices. The chunks of a choice add
up to the whole answer's text and tokens: text that may turn out to be part of a stop text (or, with
tools, of a tool call) is held back until it is known; tool calls come in the last chunk, whole.

What the embedded server cannot do (penalties, per-request seeds of sampled requests,
`best_of`, `suffix`, chat `echo`) is refused with a message saying so, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, overload

from arealcli.runtime.wire.sglang import (
    MAX_INT,
    MAX_TOKENS,
    ProtocolError,
    Sampling,
    finite,
    parse_sampling,
    shown,
    token_ids,
)
from arealcli.runtime.wire.tool_calls import FORMATS, ToolFormat, format_of

MAX_TOP_LOGPROBS = 20  # alternatives per token (vLLM's default limit)

# Fields accepted only at their neutral values (None and these), where an endpoint does not take them.
_NEUTRAL: dict[str, tuple] = {
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (False, True),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
}
_WHY = {
    "tools": "tools are offered through /v1/chat/completions (`tools` and `tool_choice`)",
    "echo": "echo is for /v1/completions",
}
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "return_token_ids", "skip_special_tokens"}
_COMMON = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "stream",
    "stream_options",
    "seed",
    "ignore_eos",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}


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
    tool_format: ToolFormat | None = None  # how the model writes calls (with tools)
    tool_start: str = ""  # the start of a call put after the generation prompt (tool_choice required/named)
    top_logprobs: int = 0  # alternatives per token (completions' `logprobs: N`, chat's `top_logprobs`)
    echo: bool = False  # completions: the prompt (and its log-probs) before the generated text
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    model: str | None = None  # `model`: a served LoRA adapter's name picks it (else the base model)
    adapter: str | None = None  # the adapter `model` named, once the server resolved it
    images: list[Any] | None = None  # per prompt, its images as the server encoded them (or None)


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    refusal = f"{key} must be a number in [{lo:g}, {hi:g}]"
    number = finite(v, refusal)
    if not lo <= number <= hi:
        raise ProtocolError(f"{refusal} (got {shown(v)})")
    return number


@overload
def _integer(body: dict, key: str, default: int, lo: int, hi: int = MAX_INT) -> int: ...
@overload
def _integer(body: dict, key: str, default: None, lo: int, hi: int = MAX_INT) -> int | None: ...
def _integer(body: dict, key: str, default: int | None, lo: int, hi: int = MAX_INT) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProtocolError(f"{key} must be an integer in [{lo}, {hi}] (got {shown(v)})")
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
                f"{key}={shown(value)} is not supported by the embedded server" + (f": {why}" if why else "")
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
        raise ProtocolError(f"stop must be a text or a list of up to 4 texts (got {shown(stop)})")
    return tuple(dict.fromkeys(texts)), token_ids(body.get("stop_token_ids") or [], "stop_token_ids")


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


def _flag(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise ProtocolError(f"{key} must be true or false (got {shown(v)})")
    return bool(v)


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream, options = _flag(body, "stream"), body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ProtocolError("stream_options is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ProtocolError(f"stream_options must be {{include_usage: bool}} (got {shown(options)})")
    if options.get("continuous_usage_stats"):
        raise ProtocolError("stream_options.continuous_usage_stats is not supported by the embedded server")
    return True, _flag(options, "include_usage")


def _top(body: dict, key: str) -> int:
    top = _integer(body, key, 0, 0)
    if top > MAX_TOP_LOGPROBS:
        raise ProtocolError(f"{key} must be at most {MAX_TOP_LOGPROBS} (got {top})")
    return top


def _sampling(body: dict, max_tokens: int | None, stops: tuple[tuple[str, ...], tuple[int, ...]]) -> Sampling:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 63:
            raise ProtocolError(f"seed must be a 64-bit integer (got {shown(seed)})")
        if temperature != 0 and max_tokens != 0:
            raise ProtocolError(
                "seed is not supported by the embedded server for sampled requests (it has no per-request "
                "seed); it is accepted with temperature 0, where it changes nothing"
            )
    top_k = _integer(body, "top_k", -1, -1)
    if top_k == 0:
        raise ProtocolError("top_k must be -1 (all tokens) or at least 1 (got 0)")
    min_tokens = _integer(body, "min_tokens", 0, 0, MAX_TOKENS)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ProtocolError(f"ignore_eos must be true or false (got {shown(ignore_eos)})")
    if ignore_eos:  # vLLM's: every sample runs to max_tokens (here EOS is never drawn before then)
        if max_tokens is None:
            raise ProtocolError("ignore_eos needs max_tokens (else a sample would run to the context length)")
        min_tokens = max_tokens
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


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError(f"model must be a string (got {shown(model)})")
    return model


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
    logprobs = body.get("logprobs") is not None
    top = _top(body, "logprobs")
    max_tokens = _integer(body, "max_tokens", 16, 0, MAX_TOKENS)  # OpenAI's default for completions
    stops = _stops(body)
    stream, usage = _stream(body)
    return OpenAIRequest(
        prompts,
        _sampling(body, max_tokens, stops),
        logprobs,
        False,
        *stops,
        top_logprobs=top,
        echo=_flag(body, "echo"),
        model=_model(body),
        stream=stream,
        include_usage=usage,
    )


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
            raise ProtocolError(f"{where}.function.arguments is not JSON (got {shown(args)})") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def content_parts(content: list[Any], where: str, image_mark: str | None) -> tuple[str, list[str]]:
    """OpenAI content parts as text (text parts joined, each `image_url` part an `image_mark`) and the
    image parts' URLs in order. ProtocolError naming `where` for any other part, and for image parts when
    `image_mark` is None (a model that reads no images)."""
    texts, urls = [], []
    for k, part in enumerate(_as_dict(p) for p in content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            if image_mark is None:
                raise ProtocolError(f"{where}[{k}]: the served model does not read images")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ProtocolError(f"{where}[{k}].image_url needs a url")
            urls.append(url)
            texts.append(image_mark)
        else:
            raise ProtocolError(f"{where}[{k}]: only text and image_url parts are supported")
    return "".join(texts), urls


def chat_message(message: Any, i: int, image_mark: str | None = None) -> dict[str, Any]:
    """One OpenAI message as chat templates take it: text content (text parts joined), an assistant's
    `tool_calls` with their arguments as objects, a tool message's `tool_call_id` and `name`. With
    `image_mark` (a model that reads images), `image_url` parts become that mark in the text, their URLs
    listed in order under `images`; without it they are refused."""
    message = _as_dict(message)
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ProtocolError(f"messages[{i}] must be an object with a role and a content")
    content = message.get("content")
    images: list[str] = []
    if isinstance(content, list):  # [{type: text, text} | {type: image_url, image_url: {url}}] parts
        content, images = content_parts(content, f"messages[{i}].content", image_mark)
    calls = message.get("tool_calls") or []
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise ProtocolError(f"messages[{i}].content must be a text (got {type(content).__name__})")
    out: dict[str, Any] = {"role": message["role"], "content": content}
    if images:
        out["images"] = images
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


@dataclass
class OfferedTools:
    """The tools a chat request offers the model, and how its calls are written and read."""

    tools: list[dict] | None = None  # None: no tools in the prompt (none offered, or tool_choice none)
    parallel: bool = True  # several calls may come back (parallel_tool_calls)
    format: ToolFormat | None = None
    start: str = ""  # the start of a call written for the model (tool_choice required or named)


def parse_tools(body: dict, template: str | None, format_name: str | None = None) -> OfferedTools:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`; the format is the one named
    (`format_name`) or the chat template's (tool_calls.format_of)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError(f"parallel_tool_calls must be true or false (got {shown(parallel)})")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ProtocolError(f"tool_choice={shown(choice)} needs tools")
        return OfferedTools(parallel=parallel is not False)
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
        return OfferedTools(parallel=parallel is not False)  # as vLLM: the tools stay out of the prompt
    names = [t["function"]["name"] for t in tools]
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and (choice.get("type") != "function" or named not in names):
        raise ProtocolError(
            f"tool_choice={shown(choice)} must be auto, none, required or "
            f"{{type: function, function: {{name}}}} naming an offered tool ({', '.join(names)})"
        )
    if not isinstance(choice, dict) and choice not in (None, "auto", "required"):
        raise ProtocolError(f"tool_choice={shown(choice)} must be auto, none, required or a named function")
    form = format_of(template, format_name)
    if form is None:
        raise ProtocolError(
            "tools need a chat template that writes tool calls in a known format "
            f"({', '.join(sorted(FORMATS))}); the served one shows none of them: name one "
            "(areal serve --tool-call-parser NAME)"
        )
    return OfferedTools(tools, parallel is not False, form, form.start(choice))


def parse_chat_request(
    body: Any, render, template: str | None, image_mark: str | None = None, tool_format: str | None = None
) -> OpenAIRequest:
    """`render(messages, tools, start) -> (token ids, images)` applies the served tokenizer's chat template
    (`template`), `start` after its generation prompt; `image_mark`: see `chat_message`; `tool_format`:
    the tool-call format named by the server (else the template's)."""
    body = _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list of {role, content}")
    offered = parse_tools(body, template, tool_format)
    top = _top(body, "top_logprobs")
    logprobs = _flag(body, "logprobs")
    if top and not logprobs:
        raise ProtocolError("top_logprobs needs logprobs: true")
    max_tokens = _integer(body, "max_completion_tokens", None, 0, MAX_TOKENS)
    max_tokens = _integer(body, "max_tokens", None, 0, MAX_TOKENS) if max_tokens is None else max_tokens
    stops = _stops(body)
    stream, usage = _stream(body)
    sampling = _sampling(body, max_tokens, stops)
    # rendered last: a request with a bad field is refused before the template's work
    messages = [chat_message(m, i, image_mark) for i, m in enumerate(messages)]
    prompt, images = render(messages, offered.tools, offered.start)
    return OpenAIRequest(
        [prompt],
        sampling,
        logprobs,
        True,
        *stops,
        offered.tools,
        offered.parallel,
        offered.format,
        offered.start,
        top_logprobs=top,
        stream=stream,
        include_usage=usage,
        model=_model(body),
        images=[images],
    )


# vLLM's token-in, token-out endpoint (POST /inference/v1/generate): what token-level trainers' clients
# call (verifiers' training client among them): prompt token ids in, sampled token ids and their log-probs
# out, no text on either side
TOKEN_FIELDS = {"model", "token_ids", "sampling_params", "request_id"}
TOKEN_SAMPLING = {
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "logprobs",
    "skip_special_tokens",
}


@dataclass
class TokenRequest:
    token_ids: list[int]
    sampling: Sampling
    request_id: str
    model: str | None = None


def parse_token_request(body: Any) -> TokenRequest:
    """A body of vLLM's `/inference/v1/generate`: `token_ids`, `sampling_params` (temperature, top_p,
    top_k, max_tokens, min_tokens, stop_token_ids, ignore_eos, n; logprobs 0 or 1: the sampled token's
    log-prob is always returned; skip_special_tokens: no text is made), `model`, `request_id`."""
    body = _check_fields(body, TOKEN_FIELDS)
    ids = body.get("token_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise ProtocolError("token_ids must be a non-empty list of token ids >= 0")
    raw = body.get("sampling_params") or {}
    if not isinstance(raw, dict):
        raise ProtocolError("sampling_params must be an object")
    unknown = sorted(set(raw) - TOKEN_SAMPLING)
    if unknown:
        raise ProtocolError(f"unknown sampling_params {unknown}")
    if raw.get("logprobs") not in (None, 0, 1, True, False):
        raise ProtocolError("sampling_params.logprobs: only the sampled token's log-prob (0 or 1) is served")
    renamed = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
    kept = {renamed.get(k, k): v for k, v in raw.items() if k not in ("logprobs", "skip_special_tokens")}
    if kept.get("top_k") == 0:  # vLLM's "all tokens" is 0 or -1
        kept["top_k"] = -1
    sampling = parse_sampling({k: v for k, v in kept.items() if v is not None})
    rid = body.get("request_id")
    model = _model(body)
    return TokenRequest(ids, sampling, rid if isinstance(rid, str) and rid else uuid.uuid4().hex, model)


def token_response(request_id: str, samples: list[tuple[list[int], list[float], str]]) -> dict[str, Any]:
    """vLLM's answer: a choice per sample, its token ids and `logprobs.content[i].token` = `token_id:<id>`."""
    return {
        "request_id": request_id,
        "choices": [
            {
                "index": i,
                "token_ids": ids,
                "finish_reason": finish,
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{t}", "logprob": _lp(v)} for t, v in zip(ids, lps, strict=True)
                    ]
                },
            }
            for i, (ids, lps, finish) in enumerate(samples)
        ],
    }


Top = list[tuple[str, float]]  # a position's most likely tokens: (text, log-prob), best first


@dataclass
class Logprobs:
    """The log-probs of a run of tokens: each token's text, its log-prob (None: a prompt's first token,
    which nothing predicts), and its top alternatives (None there too; all empty when not asked for)."""

    texts: list[str] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)
    tops: list[Top | None] = field(default_factory=list)

    def __add__(self, other: Logprobs) -> Logprobs:
        return Logprobs(self.texts + other.texts, self.values + other.values, self.tops + other.tops)


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
    tops: list[Top] = field(default_factory=list)  # each token's alternatives (when asked for)
    echo: str | None = None  # the prompt's text, when echoed
    prompt_logprobs: Logprobs | None = None  # the echoed prompt's (when log-probs were asked for)
    call_text: str | None = None  # with tools: the reply as tool calls are read from (tool_calls.call_text)

    def generated_logprobs(self) -> Logprobs:
        return Logprobs(
            self.token_texts,
            list(self.logprobs),
            list(self.tops) if self.tops else [[] for _ in self.output_ids],
        )


def _lp(v: float) -> float:
    """A log-prob JSON can carry (-inf, of a token sampling could not draw, as vLLM: -9999)."""
    return v if math.isfinite(v) else -9999.0


def completion_logprobs(lp: Logprobs, top_n: int, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions `logprobs` of these tokens; the first one's text starts at `offset`."""
    offsets = []
    for t in lp.texts:
        offsets.append(offset)
        offset += len(t)
    tops: list[dict[str, float] | None] | None = None
    if top_n > 0:
        tops = []
        for text, value, top in zip(lp.texts, lp.values, lp.tops, strict=True):
            if top is None or value is None:
                tops.append(None)
                continue
            best: dict[str, float] = {}
            for t, v in top[:top_n]:
                best.setdefault(t, _lp(v))
            best.setdefault(text, _lp(value))  # the chosen token is always there (OpenAI, vLLM)
            tops.append(best)
    return {
        "tokens": lp.texts,
        "token_logprobs": [None if v is None else _lp(v) for v in lp.values],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(lp: Logprobs, top_n: int) -> dict[str, Any]:
    """OpenAI's chat `logprobs` ({content: [...]}) of these tokens."""

    def entry(t: str, v: float) -> dict[str, Any]:
        return {"token": t, "logprob": _lp(v), "bytes": list(t.encode())}

    return {
        "content": [
            {**entry(t, v or 0.0), "top_logprobs": [entry(a, b) for a, b in (top or [])[:top_n]]}
            for t, v, top in zip(lp.texts, lp.values, lp.tops, strict=True)
        ]
    }


def _tool_message(req: OpenAIRequest, c: Choice) -> tuple[dict[str, Any], str]:
    """The assistant message of a chat choice and its finish reason (tool calls parsed when tools)."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if req.tools and req.tool_format is not None:
        text = c.call_text if c.call_text is not None else c.text
        content, calls = req.tool_format.parse(text, req.tools, req.parallel_tool_calls)
        if calls:
            return (
                {"role": "assistant", "content": content, "tool_calls": calls},
                "tool_calls" if c.finish == "stop" else c.finish,
            )
    return message, c.finish


def choice_logprobs(req: OpenAIRequest, c: Choice) -> dict[str, Any] | None:
    """The whole `logprobs` of a choice (the echoed prompt's first), or None when not asked for."""
    if not req.logprobs:
        return None
    lp = c.generated_logprobs()
    if req.chat:
        return chat_logprobs(lp, req.top_logprobs)
    if c.prompt_logprobs is not None:
        lp = c.prompt_logprobs + lp
    return completion_logprobs(lp, req.top_logprobs)


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
            item["message"], item["finish_reason"] = _tool_message(req, c)
        else:
            item["text"] = (c.echo or "") + c.text
        item["logprobs"] = choice_logprobs(req, c)
        out.append(item)
    return {
        "id": f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, sum(len(c.output_ids) for c in choices)),
    }


def usage(prompt_tokens: int, generated: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
    }


# ------------------------------------------------------------------ streaming


def streamable(text: str, req: OpenAIRequest) -> int:
    """How much of a choice's text so far may be streamed: not from a stop text on (nor from a tool call,
    when tools are offered), not a tail that may begin one, not a trailing half character, and with
    tools no trailing whitespace (a tool call after it drops it)."""
    if req.tools and req.tool_format is not None and (req.tool_start or req.tool_format.visible is None):
        return 0  # a call that special tokens hide, or one started for the model: known at the end
    visible = req.tool_format.visible if req.tools and req.tool_format is not None else None
    markers = req.stop_texts + ((visible,) if visible else ())
    end = len(text)
    for m in markers:
        at = text.find(m)
        if at >= 0:
            end = min(end, at)
    held = 0
    for m in markers:  # the longest tail of text[:end] that begins a marker
        for k in range(min(len(m) - 1, end), held, -1):
            if text.endswith(m[:k], 0, end):
                held = k
                break
    end -= held
    if req.tools:
        end = len(text[:end].rstrip())
    while end and text[end - 1] == "\ufffd":  # a character whose bytes are not all there yet
        end -= 1
    return end


@dataclass
class ChunkPiece:
    """What one chunk of a choice adds."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, Any] | None = None
    finish: str | None = None
    stop_reason: Any = None
    tool_calls: list[dict] | None = None
    first: bool = False  # the choice's first chunk (chat: the role)
    extra: dict[str, Any] = field(default_factory=dict)  # prompt_token_ids, weight_version, ...


def chunk(
    req: OpenAIRequest, rid: str, created: int, model: str, index: int | None, piece: ChunkPiece | None
) -> dict[str, Any]:
    """One streamed chunk: choice `index`'s piece, or (piece None) the usage chunk's frame."""
    out: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
    }
    if piece is not None:
        item: dict[str, Any] = {"index": index}
        if req.chat:
            delta: dict[str, Any] = {"role": "assistant"} if piece.first else {}
            if piece.text or piece.first:
                delta["content"] = piece.text
            if piece.tool_calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(piece.tool_calls)]
            item["delta"] = delta
        else:
            item["text"] = piece.text
        item.update(
            logprobs=piece.logprobs,
            finish_reason=piece.finish,
            stop_reason=piece.stop_reason,
            token_ids=piece.token_ids,
            **piece.extra,
        )
        out["choices"] = [item]
    if req.include_usage:
        out["usage"] = None
    return out


def chat_tool_calls(req: OpenAIRequest, c: Choice) -> tuple[str | None, list[dict] | None, str]:
    """A chat choice's content, tool calls (None when none) and finish reason."""
    message, finish = _tool_message(req, c)
    return message["content"], message.get("tool_calls"), finish


def models_response(model: str, adapters: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """The served model, and each LoRA adapter served over it (`parent`: the base, as vLLM lists them)."""
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "arealcli"}]
        + [
            {"id": name, "object": "model", "created": 0, "owned_by": "arealcli", "parent": model}
            for name in adapters
        ],
    }
