"""SGLang's native HTTP protocol: the JSON of `/generate` and `/update_weights_from_disk`.

Mirrors `sglang/srt/managers/io_struct.py` (GenerateReqInput, UpdateWeightFromDiskReqInput) and the
generated contract `sglang/api/v1/api_types.py` (GenerateRequest, SamplingParams, GenerateResponse).
No torch here: the client side imports this too.

    POST /generate {"input_ids": [int] | [[int]] | "text": str | [str], "rid": str | [str],
                    "sampling_params": {...} | [{...}], "return_logprob": bool | [bool]}
    -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
        "cached_tokens", "weight_version", "e2e_latency", "output_token_logprobs": [[lp, id, text], ...]}}

A request answers one object, or a list when it is a batch or n > 1 (prompt-major: prompt 0's n samples,
then prompt 1's). finish_reason is {"type": "stop", "matched": id}, {"type": "length", "length": n} or
{"type": "abort", "message": ...}; an aborted sample carries what it generated so far.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from arealcli.schema.components.engine import GenerationHyperparameters

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
TOP_K_ALL = 1 << 30  # SGLang's "no top-k"
MAX_TOKENS = 1 << 22  # the most tokens a request may ask for (beyond any model's context)
MAX_INT = (1 << 31) - 1  # other integers (token ids, n, top_k): what every tensor index holds

# Sampling params that only shape the returned text: accepted, nothing to do here.
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
# SGLang features the embedded server does not implement: accepted only at their neutral values.
_NEUTRAL_SAMPLING: dict[str, tuple] = {
    "stop_regex": (None, "", []),
    "min_p": (0.0,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "sampling_seed": (None,),
    "custom_params": (None,),
    "beam_width": (None, 1),
    "watermark": (None,),
    "choice": (None, []),
}
_NEUTRAL_REQUEST: dict[str, tuple] = {
    "input_embeds": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "logprob_start_len": (None, -1),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "return_hidden_states": (None, False),
    "session_params": (None,),
    "custom_logit_processor": (None,),
    "stream": (None, False),
}


class ProtocolError(ValueError):
    """A request the server refuses (HTTP 400); the message says what and why."""


# --------------------------------------------------------------------------- sampling params


@dataclass(frozen=True)
class Sampling:
    """The sampling params of one prompt, as the embedded server implements them."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all tokens
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop texts (may span tokens)
    ignore_eos: bool = False
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1  # SGLang: temperature ~ 0 means greedy

    def batch_key(self) -> Sampling:
        """Samples whose params differ only in these fields run in one generate call."""
        return dataclasses.replace(self, max_new_tokens=0, n=1)

    def hyperparameters(self, max_new_tokens: int) -> GenerationHyperparameters:
        return GenerationHyperparameters(
            n=1,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min(self.min_new_tokens, max_new_tokens),
            greedy=self.greedy,
            temperature=self.temperature if not self.greedy else 1.0,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=list(self.stop_token_ids),
            stop=list(self.stop),
        )


def _int(raw: dict, key: str, default: int, minimum: int, maximum: int = MAX_INT) -> int:
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise ProtocolError(
            f"sampling_params.{key} must be an integer in [{minimum}, {maximum}] (got {shown(v)})"
        )
    return v


def _float(raw: dict, key: str, default: float) -> float:
    v = raw.get(key)
    return default if v is None else finite(v, f"sampling_params.{key} must be a finite number")


def finite(value: Any, refusal: str) -> float:
    """A JSON number as a finite float; otherwise a ProtocolError `refusal (got value)` (`refusal` names
    the field and what it must be). Refused: booleans, non-numbers, NaN and the infinities, and integers
    beyond a float's range (JSON integers are unbounded; converting one that large raises OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{refusal} (got {shown(value)})")
    try:
        number = float(value)
    except OverflowError:
        raise ProtocolError(f"{refusal} (got {shown(value)})") from None
    if not math.isfinite(number):
        raise ProtocolError(f"{refusal} (got {shown(value)})")
    return number


_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 60, 60, 40


def shown(value: Any) -> str:
    """`value` for an error message, abbreviated (a hostile value can be huge: its whole repr is never made)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    try:
        return _SHOWN.repr(value)
    except ValueError:  # an integer beyond 4300 digits inside a list
        return f"a {type(value).__name__} too large to show"


MAX_STOP_IDS = 1024  # the most stop token ids a request may give


def token_ids(value: Any, field: str) -> tuple[int, ...]:
    """A list of at most MAX_STOP_IDS token ids (integers in [0, MAX_INT]; the server checks them against
    its vocabulary)."""
    if value is None:
        return ()
    if isinstance(value, list) and len(value) > MAX_STOP_IDS:
        raise ProtocolError(f"{field} has {len(value)} token ids; at most {MAX_STOP_IDS} are accepted")
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT for t in value
    ):
        raise ProtocolError(f"{field} must be a list of token ids (integers >= 0) (got {shown(value)})")
    return tuple(sorted(set(value)))


def parse_sampling(raw: Any) -> Sampling:
    if raw is None:
        return Sampling()
    if not isinstance(raw, dict):
        raise ProtocolError(f"sampling_params must be an object (got {type(raw).__name__})")
    known = set(_NEUTRAL_SAMPLING) | _TEXT_ONLY | {f.name for f in dataclasses.fields(Sampling)}
    unknown = sorted(set(raw) - known)
    if unknown:  # SGLang's contract rejects unknown sampling params too
        raise ProtocolError(f"unknown sampling params {unknown}")
    for key, neutral in _NEUTRAL_SAMPLING.items():
        if key in raw and raw[key] not in neutral:
            raise ProtocolError(
                f"sampling_params.{key}={shown(raw[key])} is not supported by the embedded server "
                f"(supported: {neutral[0]!r}); use an SGLang server for it"
            )
    max_new = _int(raw, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 0, MAX_TOKENS)
    min_new = _int(raw, "min_new_tokens", 0, 0, MAX_TOKENS)
    if min_new > max_new:
        raise ProtocolError(f"min_new_tokens ({min_new}) must be <= max_new_tokens ({max_new})")
    temperature = _float(raw, "temperature", 1.0)
    top_p = _float(raw, "top_p", 1.0)
    top_k = _int(raw, "top_k", -1, -1)
    if temperature < 0:
        raise ProtocolError(f"sampling_params.temperature must be non-negative (got {temperature})")
    if not 0 < top_p <= 1:
        raise ProtocolError(f"sampling_params.top_p must be in (0, 1] (got {top_p})")
    if top_k == 0:
        raise ProtocolError("sampling_params.top_k must be -1 (disable), or at least 1 (got 0)")
    stop = token_ids(raw.get("stop_token_ids") or [], "sampling_params.stop_token_ids")
    texts = raw.get("stop") or []
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts) or len(texts) > 16:
        raise ProtocolError(
            f"sampling_params.stop must be a text or a list of up to 16 non-empty texts "
            f"(got {shown(raw.get('stop'))})"
        )
    ignore_eos = raw.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise ProtocolError(f"sampling_params.ignore_eos must be a boolean (got {shown(ignore_eos)})")
    return Sampling(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k < 0 or top_k >= TOP_K_ALL else top_k,
        stop_token_ids=stop,
        stop=tuple(dict.fromkeys(texts)),
        ignore_eos=ignore_eos,
        n=_int(raw, "n", 1, 1),
    )


def sampling_params(g: GenerationHyperparameters, stop_token_ids: list[int], n: int) -> dict[str, Any]:
    """Our generation settings as SGLang sampling_params (the client side)."""
    params: dict[str, Any] = {
        "max_new_tokens": g.max_new_tokens,
        "min_new_tokens": g.min_new_tokens,
        "temperature": 0.0 if g.greedy else g.temperature,
        "top_p": 1.0 if g.greedy else g.top_p,
        "stop_token_ids": sorted(set(stop_token_ids) | set(g.stop_token_ids)),
        "n": n,
    }
    if g.stop:
        params["stop"] = list(g.stop)
    if g.top_k > 0 and not g.greedy:
        params["top_k"] = g.top_k
    return params


def generate_payload(
    prompt: list[int], params: dict[str, Any], n: int, adapter: str | None = None
) -> dict[str, Any]:
    """The /generate body the client sends for `n` samples of one prompt (with a served LoRA adapter's
    name: generated with that adapter)."""
    body = {"input_ids": prompt, "sampling_params": {**params, "n": n}, "return_logprob": True}
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def load_adapter_payload(name: str, path: str, version: int) -> dict[str, Any]:
    """The /load_lora_adapter body (SGLang's LoadLoRAAdapterReqInput, and the weight version)."""
    return {"lora_name": name, "lora_path": path, "weight_version": str(version)}


def update_weights_payload(path: str, version: int, abort: bool) -> dict[str, Any]:
    """The /update_weights_from_disk body (UpdateWeightFromDiskReqInput)."""
    return {
        "model_path": path,
        "abort_all_requests": abort,
        "weight_version": str(version),
        "flush_cache": True,
    }


# --------------------------------------------------------------------------- /generate requests


@dataclass
class GenerateRequest:
    """A parsed /generate body: one entry per prompt (before the n samples are expanded)."""

    prompts: list[list[int] | str]  # token ids, or text for the server to tokenize
    sampling: list[Sampling]
    return_logprob: list[bool]
    rids: list[str]
    is_batch: bool
    return_text_in_logprobs: bool = False
    adapters: list[str | None] = field(
        default_factory=list
    )  # `lora_path`: a served adapter's name, per prompt
    images: list[list[str]] = field(default_factory=list)  # `image_data`: each prompt's images (may be [])


def _per_prompt(value: Any, size: int, is_batch: bool, name: str) -> list[Any]:
    if is_batch and isinstance(value, list):
        if len(value) != size:
            raise ProtocolError(f"{name} has {len(value)} entries for a batch of {size} prompts")
        return value
    return [value] * size


def parse_generate(body: Any) -> GenerateRequest:
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    for key, neutral in _NEUTRAL_REQUEST.items():
        if key in body and body[key] not in neutral:
            raise ProtocolError(f"{key}={shown(body[key])} is not supported by the embedded server")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ProtocolError("give exactly one of `text` or `input_ids`")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise ProtocolError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        is_batch = isinstance(ids[0], list)
        prompts: list = ids if is_batch else [ids]
        for p in prompts:
            if (
                not isinstance(p, list)
                or not p
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
            ):
                raise ProtocolError("every prompt in input_ids must be a non-empty list of token ids >= 0")
    else:
        is_batch = isinstance(text, list)
        prompts = text if isinstance(text, list) else [text]
        if not prompts or not all(isinstance(t, str) for t in prompts):
            raise ProtocolError("text must be a string or a non-empty list of strings")
    size = len(prompts)
    sampling = [
        parse_sampling(s) for s in _per_prompt(body.get("sampling_params"), size, is_batch, "sampling_params")
    ]
    if len({s.n for s in sampling}) > 1:
        raise ProtocolError("every prompt of a batch must use the same sampling_params.n")
    logprob = [bool(x) for x in _per_prompt(body.get("return_logprob"), size, is_batch, "return_logprob")]
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(size)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(size)] if is_batch else [rid]
    else:
        rids = [str(r) for r in _per_prompt(rid, size, is_batch, "rid")]
    adapters = _per_prompt(body.get("lora_path"), size, is_batch, "lora_path")
    if not all(a is None or isinstance(a, str) for a in adapters):
        raise ProtocolError("lora_path must be a served adapter's name (or a list of names, one per prompt)")
    images = _image_data(body.get("image_data"), size, is_batch)
    return GenerateRequest(
        prompts,
        sampling,
        logprob,
        rids,
        is_batch,
        bool(body.get("return_text_in_logprobs")),
        adapters,
        images,
    )


def _image_data(value: Any, size: int, is_batch: bool) -> list[list[str]]:
    """`image_data` as SGLang takes it: for one prompt an image or a list of images; for a batch one entry
    (an image, a list, or null) per prompt. An image is a data: URL or base64 text."""
    if value is None:
        return [[] for _ in range(size)]
    per_prompt = value if is_batch else [value]
    if not isinstance(per_prompt, list) or len(per_prompt) != size:
        raise ProtocolError(f"image_data needs one entry per prompt ({size})")
    out = []
    for entry in per_prompt:
        images = [] if entry is None else entry if isinstance(entry, list) else [entry]
        if not all(isinstance(x, str) for x in images):
            raise ProtocolError("image_data: each image is a data: URL or base64 text")
        out.append(images)
    return out


# --------------------------------------------------------------------------- /generate responses


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str = "Aborted") -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def generate_response(
    rid: str,
    output_ids: list[int],
    logprobs: list[float] | None,
    finish: dict[str, Any],
    prompt_tokens: int,
    weight_version: str,
    text: str,
    e2e_latency: float,
    token_texts: list[str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "e2e_latency": e2e_latency,
    }
    if logprobs is not None:
        texts: Sequence[str | None] = token_texts or [None] * len(output_ids)
        meta["output_token_logprobs"] = [
            [lp, t, s] for lp, t, s in zip(logprobs, output_ids, texts, strict=True)
        ]
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


@dataclass
class Completion:
    """One sample of a /generate response, as the client reads it."""

    output_ids: list[int]
    logprobs: list[float]
    finish_type: str  # stop | length | abort
    finish: dict[str, Any]
    weight_version: str | None


def parse_completion(item: Any) -> Completion:
    """Read one response object; raises ValueError when it does not follow the protocol."""
    if not isinstance(item, dict) or "meta_info" not in item:
        raise ValueError(f"not a /generate response object: {str(item)[:200]}")
    meta = item["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"unknown finish_reason {finish!r}")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError("the response has no output_token_logprobs (send return_logprob: true)")
    ids = item.get("output_ids")
    if ids is None:
        ids = [e[1] for e in entries]
    if len(ids) != len(entries) or any(e[1] != t for e, t in zip(entries, ids, strict=True)):
        raise ValueError("output_ids and output_token_logprobs disagree")
    version = meta.get("weight_version")
    return Completion(
        list(ids), [float(e[0]) for e in entries], kind, finish, None if version is None else str(version)
    )
