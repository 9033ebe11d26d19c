"""The HTTP face of `areal serve`: SGLang's native endpoints, and OpenAI's, on an aiohttp server.

    POST /generate                   generate (single, batch, n > 1; logprobs)
    POST /update_weights_from_disk   {model_path, abort_all_requests?, weight_version?, flush_cache?}
    POST /abort_request              {abort_all: true}
    POST /slow_down                  {forward_sleep_time: seconds | null}  (SGLang's test hook)
    GET  /health, /health_generate   200 once the model is loaded
    GET  /get_model_info, /model_info
    GET  /get_server_info, /server_info  (internal_states: the scheduler's counters, see `scheduler`)
    GET|POST /flush_cache            nothing is cached across requests: always succeeds
    POST /v1/completions, /v1/chat/completions, GET /v1/models   OpenAI-compatible (wire/openai.py;
                                     stream: true answers server-sent events, see `EventStream`)
    POST /load_lora_adapter, /v1/load_lora_adapter       {lora_name, lora_path, weight_version?}
    POST /unload_lora_adapter, /v1/unload_lora_adapter   {lora_name}

LoRA adapters (`generation.adapters`) are served beside the base weights: a request picks one by name,
OpenAI's `model` or SGLang's `lora_path`; rows of different adapters decode in one batch.

One event-loop thread serves every connection (no thread per connection: on a busy CPU, handing requests
between many threads costs more than generating) and does the per-request work: JSON, tokenizing,
detokenizing, responses. Work that grows with a request's size is done off the loop, so /health keeps
answering: bodies over 64 KiB are parsed, and their depth and fields checked, in one worker-thread call;
long texts and chat templates are tokenized in the tokenizer's thread. The scheduler's thread only runs
the model and sampling (continuous batching: requests join the running batch between decoding steps),
and wakes the waiting requests through the loop.

No request can hurt another: every field is checked when the request is parsed (finite numbers only:
NaN and Infinity are refused, as JSON has neither; token ids within the vocabulary; integers bounded) and
refused with a 400 that names it; a text longer than the context could hold is refused before it is
tokenized; a sample whose sampling fails anyway fails its own request only. The server holds at most
`max_connections` connections (below the process's file limit): one that starts no request within 5 s of
opening, or sits idle 60 s after one, is closed, and the longest-idle one is closed to make room for a new
one. Beyond `max_requests` generation requests in flight a request gets 429.

The port is bound before the model loads (a launched server holds its port from its first second);
`GET /health` with a challenge header is answered with a proof of the API key (`wire.auth`), so a launcher
can tell its own server from a process that took the port.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import hmac
import json
import logging
import math
import os
import resource
import signal
import socket
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, ClassVar

from aiohttp import web

from arealcli.errors import DataError
from arealcli.runtime import vision
from arealcli.runtime.generation.adapters import AdapterError
from arealcli.runtime.generation.model_runner import ModelRunner, WeightsRefused
from arealcli.runtime.generation.sampling import StopTexts
from arealcli.runtime.generation.scheduler import Scheduler, Sequence, UnknownAdapter
from arealcli.runtime.wire.auth import CHALLENGE_HEADER, PROOF_HEADER, key_of, proof
from arealcli.runtime.wire.openai import (
    Choice,
    ChunkPiece,
    Logprobs,
    OpenAIRequest,
    chat_logprobs,
    chat_tool_calls,
    chunk,
    completion_logprobs,
    completion_response,
    finish_of,
    models_response,
    parse_chat_request,
    parse_completion_request,
    parse_token_request,
    streamable,
    token_response,
    usage,
)
from arealcli.runtime.wire.sglang import (
    GenerateRequest,
    ProtocolError,
    Sampling,
    finite,
    generate_response,
    parse_generate,
    shown,
)
from arealcli.runtime.wire.tool_calls import call_text

logger = logging.getLogger(__name__)

MAX_CHARS_PER_TOKEN = 32  # a text longer than 32 characters per context token cannot fit: refused untokenized
MIN_TEXT_CHARS = 1 << 16  # ... but texts up to this long are always tokenized (and then measured in tokens)
INLINE_CHARS = 4096  # texts up to this long are tokenized on the event loop (a thread hop costs more)
MAX_SLOW_DOWN_S = 10.0  # /slow_down's longest sleep per decoding step
INLINE_BODY_BYTES = 64 << 10  # bodies up to this size are parsed on the event loop (a thread hop costs more)


class GenerationService:
    """The endpoints, as methods: body (parsed JSON; for an endpoint in PARSERS, the request its parser
    made of it) -> (status, JSON payload, or text when a str)."""

    # endpoint -> the parser of its body's fields, run with the JSON parse (see `read_body`)
    PARSERS: ClassVar[dict[str, Any]] = {"generate": parse_generate, "completions": parse_completion_request}

    def __init__(
        self, runner: ModelRunner, scheduler: Scheduler, max_n: int = 64, weights_dir: str | None = None
    ):
        self.runner, self.scheduler = runner, scheduler
        self.max_n = max_n  # samples per prompt in one request
        self.weights_dir = weights_dir  # /update_weights_from_disk loads only from below it (when set)
        self.served_model_name = runner.model_path
        self.tokenizer_path = runner.tokenizer_path
        self.tool_format: str | None = None  # tool calls' format (tool_calls.FORMATS); None: the template's
        self.shutting_down = False
        # one thread tokenizes long texts and renders chat templates: off the event loop, one at a time
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    @property
    def max_text_chars(self) -> int:
        """The longest text (in characters) that is tokenized: longer ones cannot fit in the context."""
        return max(MIN_TEXT_CHARS, MAX_CHARS_PER_TOKEN * self.runner.context_length)

    def check_text(self, chars: int, field: str) -> None:
        """Refuse a text of `chars` characters that cannot fit in the context, before tokenizing it."""
        if chars > self.max_text_chars:
            raise ProtocolError(
                f"{field} has {chars} characters: more than the model's context ({self.runner.context_length} "
                f"tokens) can hold; this server tokenizes at most {self.max_text_chars} characters"
            )

    async def _encode(self, text: str, field: str) -> list[int]:
        """`text`'s token ids (checked for length first); long texts are tokenized off the event loop."""
        self.check_text(len(text), field)
        if len(text) <= INLINE_CHARS:
            return self.runner.encode(text)
        return await self._off_loop(self.runner.encode, text)

    def close(self) -> None:
        """Stop the tokenizer's thread (the server stops): tokenizing queued meanwhile is cancelled."""
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn, *args):
        """fn(*args) in the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    def _check_ids(self, sampling: Sampling, field: str) -> None:
        """Token ids of the sampling params must be in the served vocabulary."""
        bad = [t for t in sampling.stop_token_ids if t >= self.runner.vocab_size]
        if bad:
            raise ProtocolError(
                f"{field}: token id {bad[0]} is out of the vocabulary (size {self.runner.vocab_size})"
            )

    async def generate(self, req: GenerateRequest) -> tuple[int, Any]:
        t0 = time.perf_counter()
        self._check_size(len(req.prompts), req.sampling[0].n)
        r = self.runner
        per_prompt: list[list[Sequence]] = []
        adapters = req.adapters or [None] * len(req.prompts)
        for a in {a for a in adapters if a is not None}:
            if a not in r.adapters:
                raise ProtocolError(str(UnknownAdapter(a)))
        images = req.images or [[] for _ in req.prompts]
        if any(images) and r.images is None:
            raise ProtocolError("image_data: the served model does not read images")
        for prompt, sampling, rid, adapter, sent in zip(
            req.prompts, req.sampling, req.rids, adapters, images, strict=True
        ):
            self._check_ids(sampling, "sampling_params.stop_token_ids")
            seen = None
            if sent:
                if isinstance(prompt, str):
                    self.check_text(len(prompt), "text")
                ids, seen = await self._off_loop(self._with_images, prompt, sent, "image_data")
            else:
                ids = prompt if isinstance(prompt, list) else await self._encode(prompt, "text")
            if not ids:
                raise ProtocolError("a prompt encodes to no tokens; give at least one")
            if sampling.stop and r.tokenizer is None:
                raise ProtocolError(
                    f"{r.model_path} has no tokenizer: stop texts need one (use stop_token_ids)"
                )
            if len(ids) >= r.context_length:
                raise ProtocolError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({r.context_length} tokens)."
                )
            if max(ids) >= r.vocab_size:
                raise ProtocolError(f"token id {max(ids)} is out of the vocabulary (size {r.vocab_size})")
            max_new = min(sampling.max_new_tokens, r.context_length - len(ids))
            rids = [rid] if sampling.n == 1 else [f"{rid}-{j}" for j in range(sampling.n)]
            per_prompt.append(
                [Sequence(x, ids, sampling, max_new, adapter=adapter, images=seen) for x in rids]
            )
        seqs = [s for group in per_prompt for s in group]
        errors = await self._run(seqs)
        if errors:
            return 500, {"error": {"message": errors[0]}}
        latency = time.perf_counter() - t0
        out = []
        for group, want_logprob in zip(per_prompt, req.return_logprob, strict=True):
            for s in group:
                texts = r.token_texts(s.output_ids) if want_logprob and req.return_text_in_logprobs else None
                out.append(
                    generate_response(
                        s.rid,
                        s.output_ids,
                        s.logprobs if want_logprob else None,
                        s.finished_as,
                        len(s.prompt),
                        s.weight_version,
                        r.decode(s.output_ids),
                        latency,
                        texts,
                    )
                )
        return 200, out if req.is_batch or len(out) > 1 else out[0]

    def _check_size(self, prompts: int, n: int) -> None:
        """A request asks for at most `max_n` samples per prompt and `max_batch_size` prompts."""
        if n > self.max_n:
            raise ProtocolError(
                f"n={n} exceeds this server's limit of {self.max_n} samples per prompt (areal serve --max-n)"
            )
        if prompts > self.scheduler.max_batch_size:
            raise ProtocolError(
                f"the request has {prompts} prompts; this server takes at most {self.scheduler.max_batch_size} "
                "in one request (areal serve --max-batch-size)"
            )

    async def _run(self, seqs: list[Sequence]) -> list[str]:
        """Generate `seqs` (batched with whatever else is waiting); their errors."""
        loop = asyncio.get_running_loop()
        waits = []
        for s in seqs:
            done = loop.create_future()
            s.on_done = lambda done=done: loop.call_soon_threadsafe(_resolve, done)
            waits.append(done)
        self.scheduler.submit(seqs)
        await asyncio.gather(*waits)
        return [s.error for s in seqs if s.error]

    # ------------------------------------------------------------------ OpenAI-compatible

    async def _prompt_ids(self, prompt: list[int] | str, room: int = 1) -> list[int]:
        """A prompt's token ids, checked; `room`: the context positions it must leave for generation."""
        ids = prompt if isinstance(prompt, list) else await self._encode(prompt, "prompt")
        return self._checked_prompt(ids, room)

    def _checked_prompt(self, ids: list[int], room: int = 1) -> list[int]:
        r = self.runner
        if not ids:
            raise ProtocolError("a prompt encodes to no tokens; give at least one")
        if len(ids) > r.context_length - room:
            raise ProtocolError(
                f"the prompt ({len(ids)} tokens) leaves no room in the model's context ({r.context_length} tokens)"
            )
        if max(ids) >= r.vocab_size or min(ids) < 0:
            raise ProtocolError(f"token id {max(ids)} is out of the vocabulary (size {r.vocab_size})")
        return ids

    def _with_images(self, prompt: str | list[int], sent: list[str], field: str) -> tuple[list[int], Any]:
        """A prompt's token ids with its images' placeholders, and the images as the model reads them
        ((pixel_values, image_grid_thw)); run in the tokenizer's thread. Images come in the request
        only (data: URLs, base64): nothing is fetched or read from disk."""
        encoder = self.runner.images
        assert encoder is not None
        try:
            return encoder.request(self.runner.tokenizer, prompt, sent)
        except DataError as e:
            raise ProtocolError(f"{field}: {e}") from None

    def _render_chat(
        self, messages: list[dict], tools: list[dict] | None, start: str = ""
    ) -> tuple[list[int], Any]:
        """The chat's prompt tokens and its images (run in the tokenizer's thread), `start` (a tool call
        started for the model) after the generation prompt; texts that cannot fit are refused first."""
        sent = [url for m in messages for url in m.pop("images", [])]
        chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        self.check_text(chars, "messages")
        tok = self.runner.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ProtocolError(
                "the served tokenizer has no chat template: use /v1/completions with a rendered prompt"
            )
        try:
            rendered = tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # the template's own checks (roles, order) raise
            raise ProtocolError(f"the chat template cannot render these messages: {e}") from None
        rendered += start
        if sent:
            ids, seen = self._with_images(rendered, sent, "messages")
            return self._checked_prompt(ids), seen
        return self._checked_prompt(tok.encode(rendered, add_special_tokens=False)), None

    async def _openai(self, req: OpenAIRequest) -> tuple[int, Any]:
        """Every prompt's n choices, whole or streamed (`EventStream`); every sample runs as its own task
        (submitted together: they batch), continued on the new weights when a weight update aborts it."""
        r = self.runner
        if req.model is not None and req.model in r.adapters:
            req.adapter = req.model
        elif req.model is not None and r.adapters.names() and req.model != self.served_model_name:
            return 404, not_found(req.model, [self.served_model_name, *r.adapters.names()])
        self._check_size(len(req.prompts), req.sampling.n)
        self._check_ids(req.sampling, "stop_token_ids")
        if req.top_logprobs and r.tokenizer is None:
            raise ProtocolError(f"{r.model_path} has no tokenizer: top log-probs are keyed by token text")
        room = 0 if req.sampling.max_new_tokens == 0 else 1  # echo with max_tokens 0: only scored
        prompts = [await self._prompt_ids(p, room) for p in req.prompts]
        samples = [
            _Sample(ids, min(req.sampling.max_new_tokens, r.context_length - len(ids)), seen)
            for ids, seen in zip(prompts, req.images or [None] * len(prompts), strict=True)
            for _ in range(req.sampling.n)
        ]
        echoes = [
            (p if isinstance(p, str) else r.decode(ids)) if req.echo else ""
            for p, ids in zip(req.prompts, prompts, strict=True)
        ]
        if req.stream:
            return 200, EventStream(
                lambda write, closed: self._stream(req, prompts, samples, echoes, write, closed)
            )
        tasks = [asyncio.ensure_future(self._sample(s, req)) for s in samples]
        try:
            prompt_lps = await self._prompt_logprobs(req, prompts)
            await asyncio.gather(*tasks)
        finally:
            self._abandon(samples, tasks)
        failed = next((s for s in samples if s.error), None)
        if failed is not None:
            return failed.status, {"error": {"message": failed.error}}
        n = req.sampling.n
        choices = [
            self._choice(
                req,
                s,
                echoes[k // n] if req.echo else None,
                prompt_lps[k // n] if prompt_lps is not None else None,
            )
            for k, s in enumerate(samples)
        ]
        return 200, completion_response(req, choices, self._model_name(req), sum(len(p) for p in prompts))

    async def _sample(self, s: _Sample, req: OpenAIRequest) -> None:
        """Generate one choice into `s` (its error in s.error); a sample aborted by a weight update is
        continued on the new weights, one aborted by `_abandon` is not."""
        for _ in range(100):  # each round: what is left after an abort
            left = s.max_new - len(s.out)
            if left <= 0 or s.cancelled:
                if not s.versions:
                    s.versions.append(self.scheduler.version(req.adapter))
                if left <= 0:
                    s.finish = "length" if s.finish == "abort" else s.finish
                return
            sampling = req.sampling
            if s.out:
                sampling = dataclasses.replace(
                    sampling, min_new_tokens=max(0, sampling.min_new_tokens - len(s.out))
                )
            seq = Sequence(
                f"oai-{id(s):x}",
                s.prompt + s.out,
                sampling,
                left,
                top_n=req.top_logprobs,
                adapter=req.adapter,
                images=s.images,
            )
            s.seq = seq
            errors = await self._run([seq])
            if errors:
                s.error, s.seq = errors[0], None
                return
            ids = seq.output_ids
            tops = seq.top[: len(ids)] if req.top_logprobs else []
            if len(tops) < len(ids) and req.top_logprobs:  # not generated in a continuous batch
                (scored,), _ = await asyncio.to_thread(
                    self.scheduler.score,
                    [(seq.prompt + ids, len(seq.prompt))],
                    req.top_logprobs,
                    seq.sampling.hyperparameters(len(ids)),
                    req.adapter,
                    [seq.images],
                )
                tops = scored[1]
            s.out, s.lps, s.tops = s.out + ids, s.lps + seq.logprobs[: len(ids)], s.tops + tops
            s.versions.append(seq.weight_version)
            s.finish, s.seq = seq.finished_as["type"], None
            if s.finish != "abort":
                return
        s.error, s.status = "requests kept being aborted (weight updates); try again", 503

    def _abandon(self, samples: list[_Sample], tasks: list[asyncio.Task[None]]) -> None:
        """Abort the samples still generating (their client went away, or the server is stopping)."""
        live = [s for s, t in zip(samples, tasks, strict=True) if not t.done()]
        for s in live:
            s.cancelled = True
        running = [s.seq for s in live if s.seq is not None]
        if running:
            self.scheduler.abort(running)
        for t in tasks:
            t.cancel()

    def _pieces(self, ids) -> dict[int, str]:
        """Each token's own text (one batched decode)."""
        tok = self.runner.tokenizer
        unique = list(dict.fromkeys(ids))
        if tok is None:
            return dict.fromkeys(unique, "")
        return dict(zip(unique, tok.batch_decode([[t] for t in unique]), strict=True))

    async def _prompt_logprobs(self, req: OpenAIRequest, prompts: list[list[int]]) -> list[Logprobs] | None:
        """The prompts' own log-probs, when echoed with log-probs: one forward pass over each (batched),
        off the event loop."""
        if not (req.echo and req.logprobs):
            return None
        scored, _ = await asyncio.to_thread(
            self.scheduler.score, [(ids, 1) for ids in prompts], req.top_logprobs, None, req.adapter
        )
        pieces = self._pieces(
            [t for ids in prompts for t in ids] + [t for _, tops in scored for top in tops for t, _ in top]
        )
        out = []
        for ids, (lps, tops) in zip(prompts, scored, strict=True):
            alternatives: list = [[(pieces[t], v) for t, v in top] for top in tops] or [[] for _ in lps]
            out.append(Logprobs([pieces[t] for t in ids], [None, *lps], [None, *alternatives]))
        return out

    def _choice(self, req: OpenAIRequest, s: _Sample, echo: str | None, prompt_lp: Logprobs | None) -> Choice:
        r = self.runner
        out, lps, tops, finish = s.out, s.lps, s.tops, s.finish
        if req.stop_texts:  # a stop text across an abort: cut after the token that completes it
            end = StopTexts(req.stop_texts, r.decode).first_end(out)
            if end is not None:
                out, lps, tops, finish = out[:end], lps[:end], tops[:end], "stop"
        reason, stopped_by, text = finish_of(out, finish, r.decode, req.stop_texts, req.stop_ids)
        pieces = self._pieces(out + [t for top in tops for t, _ in top]) if req.logprobs else {}
        return Choice(
            s.prompt,
            out,
            lps,
            reason,
            stopped_by,
            text,
            [pieces[t] for t in out] if req.logprobs else [],
            s.versions,
            [[(pieces[t], v) for t, v in top] for top in tops] if req.top_logprobs else [],
            echo,
            prompt_lp,
            call_text(out, req.tool_start, r.decode, self._decode_raw) if req.tools else None,
        )

    def _decode_raw(self, ids: list[int]) -> str:
        """Token ids as text with their special tokens (where tool-call formats put their marks)."""
        tok = self.runner.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""

    async def _stream(
        self,
        req: OpenAIRequest,
        prompts: list[list[int]],
        samples: list[_Sample],
        echoes: list[str],
        write,
        closed,
    ) -> None:
        """Write the choices as they are generated: each poll (every 20 ms, or when a sample ends) sends
        every choice's new tokens, and a choice's last chunk once it ends. A client gone aborts them."""
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        created, model, n = int(time.time()), self._model_name(req), req.sampling.n
        tasks = [asyncio.ensure_future(self._sample(s, req)) for s in samples]
        try:
            prompt_lps = await self._prompt_logprobs(req, prompts)
            states = [_Streamed() for _ in samples]
            while True:
                ended = [t.done() for t in tasks]
                failed = next((s for s, e in zip(samples, ended, strict=True) if e and s.error), None)
                if failed is not None:
                    await write({"error": {"message": failed.error, "code": failed.status}})
                    return
                for k, (s, st) in enumerate(zip(samples, states, strict=True)):
                    lp = prompt_lps[k // n] if prompt_lps is not None else None
                    for piece in self._stream_pieces(req, s, st, ended[k], echoes[k // n], lp):
                        await write(chunk(req, rid, created, model, k, piece))
                if all(ended):
                    break
                if closed():
                    raise ConnectionResetError("the client went away")
                await asyncio.wait(
                    [t for t in tasks if not t.done()], timeout=0.02, return_when=asyncio.FIRST_COMPLETED
                )
            if req.include_usage:
                last = chunk(req, rid, created, model, None, None)
                last["usage"] = usage(sum(len(p) for p in prompts), sum(st.sent for st in states))
                await write(last)
        finally:
            self._abandon(samples, tasks)

    def _stream_pieces(
        self, req: OpenAIRequest, s: _Sample, st: _Streamed, ended: bool, echo: str, prompt_lp
    ) -> list[ChunkPiece]:
        """What choice `s` has to send now: its first chunk (chat: the role; echo: the prompt), its new
        tokens with the text that is sure to stay, and when it ended, the rest and its finish."""
        out: list[ChunkPiece] = []
        if st.ended:
            return out
        if not st.started:
            st.started = True
            first = ChunkPiece(first=True, extra={"prompt_token_ids": s.prompt})
            if req.echo:
                first.text = echo
                if prompt_lp is not None:
                    first.logprobs = completion_logprobs(prompt_lp, req.top_logprobs, 0)
                    st.offset = sum(len(t) for t in prompt_lp.texts)
            if req.chat or req.echo:
                out.append(first)
            else:
                st.extra = first.extra  # goes with the first tokens
        if ended:
            c = self._choice(req, s, None, None)
            calls = None
            if req.chat:
                content, calls, finish = chat_tool_calls(req, c)
                text = content or ""
            else:
                text, finish = c.text, c.finish
            lp = Logprobs(c.token_texts, list(c.logprobs), list(c.tops) or [[] for _ in c.output_ids])
            piece = ChunkPiece(
                text[len(st.text) :] if text.startswith(st.text) else "",
                c.output_ids[st.sent :],
                self._chunk_logprobs(req, lp, st.sent, st),
                finish,
                c.stop_reason,
                calls,
                extra={**st.extra, "weight_version": c.versions[0], "weight_version_last": c.versions[-1]},
            )
            st.ended, st.sent, st.extra = True, len(c.output_ids), {}
            return [*out, piece]
        ids, lps, tops = s.so_far(req.top_logprobs > 0)
        if len(ids) <= st.sent:
            return out
        text = self.runner.decode(ids)
        safe = text[: streamable(text, req)]
        delta = safe[len(st.text) :] if safe.startswith(st.text) else ""
        piece = ChunkPiece(delta, ids[st.sent :], None, extra=st.extra)
        if req.logprobs:
            new = ids[st.sent :]
            pieces = self._pieces(new + [t for top in tops[st.sent :] for t, _ in top])
            lp = Logprobs(
                [pieces[t] for t in new],
                list(lps[st.sent :]),
                [[(pieces[t], v) for t, v in top] for top in tops[st.sent :]] or [[] for _ in new],
            )
            piece.logprobs = self._chunk_logprobs(req, lp, 0, st)
        st.text, st.sent, st.extra = st.text + delta, len(ids), {}
        return [*out, piece]

    @staticmethod
    def _chunk_logprobs(req: OpenAIRequest, lp: Logprobs, start: int, st: _Streamed) -> dict[str, Any] | None:
        """The `logprobs` of a chunk: tokens start.. of `lp` (completions' text offsets go on from the
        choice's last chunk)."""
        if not req.logprobs:
            return None
        part = Logprobs(lp.texts[start:], lp.values[start:], lp.tops[start:])
        if req.chat:
            return chat_logprobs(part, req.top_logprobs)
        out = completion_logprobs(part, req.top_logprobs, st.offset)
        st.offset += sum(len(t) for t in part.texts)
        return out

    async def completions(self, req: OpenAIRequest) -> tuple[int, Any]:
        return await self._openai(req)

    async def chat_completions(self, body: Any) -> tuple[int, Any]:
        tok = self.runner.tokenizer
        template = getattr(tok, "chat_template", None) if tok is not None else None
        mark = vision.IMAGE_MARK if self.runner.images is not None else None
        return await self._openai(
            await self._off_loop(
                parse_chat_request, body, self._render_chat, template, mark, self.tool_format
            )
        )

    def _model_name(self, req: OpenAIRequest) -> str:
        return req.adapter if req.adapter is not None else self.served_model_name

    async def tokens_generate(self, body: Any) -> tuple[int, Any]:
        """vLLM's token-in, token-out `/inference/v1/generate`: `n` samples of `token_ids`, each its token
        ids and their log-probs (`logprobs.content[i].token` is `token_id:<id>`), no text either way."""
        req = parse_token_request(body)
        r = self.runner
        adapter = req.model if req.model is not None and req.model in r.adapters else None
        if (
            req.model is not None
            and adapter is None
            and r.adapters.names()
            and req.model != self.served_model_name
        ):
            return 404, not_found(req.model, [self.served_model_name, *r.adapters.names()])
        self._check_size(1, req.sampling.n)
        self._check_ids(req.sampling, "sampling_params.stop_token_ids")
        ids = self._checked_prompt(req.token_ids)
        max_new = min(req.sampling.max_new_tokens, r.context_length - len(ids))
        seqs = [
            Sequence(f"{req.request_id}-{j}", ids, req.sampling, max_new, adapter=adapter)
            for j in range(req.sampling.n)
        ]
        errors = await self._run(seqs)
        if errors:
            return 500, {"error": {"message": errors[0]}}
        return 200, token_response(
            req.request_id, [(s.output_ids, s.logprobs, str(s.finished_as["type"])) for s in seqs]
        )

    async def models(self, body: Any) -> tuple[int, Any]:
        return 200, models_response(self.served_model_name, self.runner.adapters.names())

    # ------------------------------------------------------------------ LoRA adapters

    async def load_lora_adapter(self, body: Any) -> tuple[int, Any]:
        """Serve the adapter in folder `lora_path` as `lora_name` (SGLang's /load_lora_adapter, vLLM's
        /v1/load_lora_adapter); a served name gets the new folder's adapter (a trainer's update), after the
        running samples. `weight_version` (optional) is what its samples report."""
        if not isinstance(body, dict) or not all(
            isinstance(body.get(k), str) for k in ("lora_name", "lora_path")
        ):
            raise ProtocolError("lora_name and lora_path (strings) are required")
        name, path = body["lora_name"], body["lora_path"]
        if self.weights_dir is not None and not _below(path, self.weights_dir):
            return 403, adapter_answer(
                False, f"this server loads adapters only from below {self.weights_dir}"
            )
        version = body.get("weight_version")
        version = "" if version is None else str(version)
        try:
            adapter = await asyncio.to_thread(  # waits for the running batch: off the event loop
                self.scheduler.change_adapter,
                lambda: self.runner.load_adapter(name, path, root=self.weights_dir, version=version),
            )
        except WeightsRefused as e:
            return 403, adapter_answer(False, str(e))
        except (AdapterError, OSError) as e:
            return 400, adapter_answer(False, f"cannot load the adapter {name!r}: {e}")
        message = f"Loaded the LoRA adapter {name!r} (rank {adapter.rank}, {len(adapter.layers)} layers)"
        return 200, adapter_answer(True, message + (f", weight version {version}." if version else "."))

    async def unload_lora_adapter(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise ProtocolError("lora_name (a string) is required")
        name = body["lora_name"]
        if name not in self.runner.adapters:
            return 404, adapter_answer(False, str(UnknownAdapter(name)))

        def unload() -> str:
            self.runner.adapters.remove(name)
            return f"Unloaded the LoRA adapter {name!r}."

        return 200, adapter_answer(True, await asyncio.to_thread(self.scheduler.change_adapter, unload))

    async def update_weights_from_disk(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return 400, {
                "success": False,
                "message": "model_path (a string) is required",
                "num_paused_requests": 0,
            }
        if self.weights_dir is not None and not _below(body["model_path"], self.weights_dir):
            return 403, {
                "success": False,
                "message": f"this server loads weights only from below {self.weights_dir}",
                "num_paused_requests": 0,
            }
        _injected_death_on_update()
        version = body.get("weight_version")
        try:  # the folder is opened and checked again under the update lock (ModelRunner.read_weights)
            ok, message = await asyncio.to_thread(  # waits for the running batch: off the event loop
                self.scheduler.update_weights,
                body["model_path"],
                None if version is None else str(version),
                bool(body.get("abort_all_requests")),
                root=self.weights_dir,
            )
        except WeightsRefused as e:  # outside the weights folder, or a symbolic link: policy, not failure
            return 403, {"success": False, "message": str(e), "num_paused_requests": 0}
        if ok:
            self.served_model_name = body["model_path"]  # SGLang moves the served name with the weights
        return (200 if ok else 400), {"success": ok, "message": message, "num_paused_requests": 0}

    async def abort_request(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not body.get("abort_all"):
            raise ProtocolError('the embedded server aborts only all requests: send {"abort_all": true}')
        self.scheduler.abort_all("Aborted by abort_request")
        return 200, ""

    async def slow_down(self, body: Any) -> tuple[int, Any]:
        """SGLang's test hook: sleep `forward_sleep_time` seconds before every decode step (null = off)."""
        sleep = body.get("forward_sleep_time") if isinstance(body, dict) else None
        refusal = f"forward_sleep_time must be a number of seconds in [0, {MAX_SLOW_DOWN_S:g}] or null"
        seconds = 0.0 if sleep is None else finite(sleep, refusal)
        if not 0 <= seconds <= MAX_SLOW_DOWN_S:
            raise ProtocolError(f"{refusal} (got {shown(sleep)})")
        self.scheduler.forward_sleep_s = seconds
        return 200, None

    async def health(self, body: Any) -> tuple[int, Any]:
        return (503 if self.shutting_down else 200), ""

    async def model_info(self, body: Any) -> tuple[int, Any]:
        return 200, {
            "model_path": self.runner.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": self.runner.images is not None,
            "has_audio_understanding": False,
            "model_type": self.runner.model_type,
            "architectures": self.runner.architectures,
        }

    async def server_info(self, body: Any) -> tuple[int, Any]:
        sch = self.scheduler
        return 200, {
            "model_path": self.runner.model_path,
            "batch_window_ms": sch.batch_window_s * 1000,
            "max_batch_size": sch.max_batch_size,
            # forward passes, samples, tokens so far; weight updates waiting for the running batch
            "internal_states": [{**sch.stats, "weight_updates_waiting": sch.updates_waiting}],
            "version": "arealcli-embedded",
        }

    async def flush_cache(self, body: Any) -> tuple[int, Any]:
        return 200, "Cache flushed.\n"


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@dataclasses.dataclass
class _Sample:
    """One OpenAI choice being generated: a prompt's j-th of n, over one or more Sequences (a weight
    update's abort continues it in a new one)."""

    prompt: list[int]
    max_new: int
    images: Any = None  # the prompt's images (pixel_values, image_grid_thw), as the model reads them
    out: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)
    tops: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    versions: list[str] = dataclasses.field(default_factory=list)
    finish: str = "length"
    seq: Sequence | None = None  # the one generating now
    cancelled: bool = False  # abandoned: not continued
    error: str | None = None
    status: int = 500

    def so_far(self, top: bool) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        """The tokens generated so far, with the running sequence's (whose lists the scheduler appends to:
        only as far as every list has the token)."""
        seq = self.seq
        if seq is None:
            return self.out, self.lps, self.tops
        ids, lps, tops = seq.output_ids, seq.logprobs, seq.top
        n = min(len(ids), len(lps), len(tops) if top else len(ids))
        return self.out + ids[:n], self.lps + lps[:n], self.tops + (tops[:n] if top else [])


@dataclasses.dataclass
class _Streamed:
    """What a streamed choice has sent."""

    sent: int = 0  # tokens
    text: str = ""  # generated text
    offset: int = 0  # the text offset of its next token (completions' logprobs)
    started: bool = False
    ended: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # for the next chunk


class EventStream:
    """A streamed answer: `run(write, closed)` writes its events (`write(obj)`: `data: JSON`); `closed()`
    says whether the client has gone. Sent as server-sent events, ended by `data: [DONE]`."""

    def __init__(self, run):
        self.run = run

    async def send(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        def closed() -> bool:
            transport = request.transport
            return transport is None or transport.is_closing()

        async def write(obj: Any) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        try:
            try:
                await self.run(write, closed)
            except ConnectionError:
                raise
            except Exception as e:  # a bug or a device error once streaming: said in the stream
                traceback.print_exc()
                message = str(e) if isinstance(e, ProtocolError | ValueError) else f"{type(e).__name__}: {e}"
                await write({"error": {"message": message}})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client went away: its samples were aborted
            pass
        return resp


ROUTES = [
    ("POST", "/generate", "generate"),
    ("PUT", "/generate", "generate"),
    ("POST", "/update_weights_from_disk", "update_weights_from_disk"),
    ("POST", "/abort_request", "abort_request"),
    ("POST", "/slow_down", "slow_down"),
    ("GET", "/slow_down", "slow_down"),
    ("GET", "/health", "health"),
    ("GET", "/health_generate", "health"),
    ("GET", "/get_model_info", "model_info"),
    ("GET", "/model_info", "model_info"),
    ("GET", "/get_server_info", "server_info"),
    ("GET", "/server_info", "server_info"),
    ("GET", "/flush_cache", "flush_cache"),
    ("POST", "/flush_cache", "flush_cache"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/chat/completions", "chat_completions"),
    ("GET", "/v1/models", "models"),
    ("POST", "/inference/v1/generate", "tokens_generate"),
    ("POST", "/load_lora_adapter", "load_lora_adapter"),
    ("POST", "/unload_lora_adapter", "unload_lora_adapter"),
    ("POST", "/v1/load_lora_adapter", "load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter", "unload_lora_adapter"),
]


def adapter_answer(success: bool, message: str) -> dict[str, Any]:
    """SGLang's LoadLoRAAdapterReqOutput fields (`message` as well, like the weight update answers)."""
    return {"success": success, "message": message, "error_message": "" if success else message}


def not_found(model: str, served: list[str]) -> dict[str, Any]:
    """vLLM's answer to a request for a model it does not serve (HTTP 404)."""
    return {
        "error": {
            "message": f"The model `{model}` does not exist. This server serves: {', '.join(served)}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def _respond(status: int, payload: Any, headers: dict[str, str] | None = None) -> web.Response:
    if isinstance(payload, str):
        return web.Response(status=status, text=payload, headers=headers)
    return web.Response(
        status=status, body=json.dumps(payload).encode(), content_type="application/json", headers=headers
    )


def _error(status: int, message: str) -> web.Response:
    return _respond(status, {"error": {"message": message}})


MAX_JSON_DEPTH = 32  # the deepest request (chat messages with tool calls and schemas) needs about 10
_TOO_DEEP = object()


def _too_deep(value: Any, raw: bytes) -> bool:
    """Whether JSON data nests deeper than MAX_JSON_DEPTH (iteratively: no recursion on hostile input).
    A body with no more brackets than the cap cannot be deeper: the walk is skipped (most requests)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > MAX_JSON_DEPTH:
                return True
            stack.extend(
                (c, depth + 1)
                for c in (v.values() if isinstance(v, dict) else v)
                if isinstance(c, dict | list)
            )
    return False


class _NotFinite:
    """What NaN, Infinity or a number beyond a float's range parses to: refused, naming where it is."""

    def __init__(self, text: str):
        self.text = text


def _path_to(value: Any, want: type) -> tuple[str, Any]:
    """The path (`a.b[2]`) of the first value of type `want` in JSON data, and that value (iterative)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, want):
            return path or "the body", v
        if isinstance(v, dict):
            stack.extend((c, f"{path}.{k}" if path else str(k)) for k, c in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((c, f"{path}[{i}]") for i, c in reversed(list(enumerate(v))))
    raise AssertionError("not found")


def parse_body(raw: bytes) -> Any:
    """A request body's JSON ({} when empty); a ProtocolError when it is not JSON or nests deeper than
    MAX_JSON_DEPTH. NaN, Infinity and numbers that overflow a float are refused, naming the field: JSON
    has none of them, though Python's json reads them (and a NaN sampling parameter would reach the
    sampler)."""
    bad: list[_NotFinite] = []

    def not_finite(text: str) -> _NotFinite:
        bad.append(_NotFinite(text))
        return bad[-1]

    def number(text: str) -> float | _NotFinite:
        value = float(text)
        return value if math.isfinite(value) else not_finite(text)

    try:
        body = json.loads(raw, parse_constant=not_finite, parse_float=number) if raw.strip() else {}
    except RecursionError:
        body = _TOO_DEEP
    except ValueError as e:
        raise ProtocolError(f"the body is not valid JSON: {e}") from None
    if body is _TOO_DEEP or _too_deep(body, raw):
        raise ProtocolError(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep")
    if bad:
        where, value = _path_to(body, _NotFinite)
        raise ProtocolError(
            f"{where} must be a finite number (got {value.text[:40]}, which JSON does not allow)"
        )
    return body


def read_body(raw: bytes, parse) -> Any:
    """A request body's JSON (`parse_body`), and the request `parse` (if any) makes of it."""
    body = parse_body(raw)
    return body if parse is None else parse(body)


# Endpoints that change what the server does for everyone: the admin key (when set) guards them.
CONTROL = {
    "update_weights_from_disk",
    "abort_request",
    "slow_down",
    "flush_cache",
    "load_lora_adapter",
    "unload_lora_adapter",
}
OPEN = {"health"}  # answered without a key (liveness probes)
MAX_NONCE = 256  # the longest challenge /health answers


def _utf8(text: str | None) -> bytes | None:
    """`text` as UTF-8, or None (a header with bytes that are not UTF-8 carries no valid key)."""
    if text is None:
        return None
    try:
        return text.encode()
    except UnicodeEncodeError:
        return None


@dataclasses.dataclass(frozen=True)
class Keys:
    """Who may call: `api` for every endpoint but /health, `admin` (default: the API key) for CONTROL."""

    api: str | None = None
    admin: str | None = None

    def refusal(self, name: str, header: str | None) -> tuple[int, str] | None:
        """(401 or 403, why) when a request with Authorization `header` may not call endpoint `name`.
        A header that is not `Bearer KEY`, or not UTF-8, is a missing key: 401 (constant-time compared)."""
        if self.api is None or name in OPEN:
            return None
        given = _utf8(key_of(header))
        api, admin = self.api.encode(), (self.admin or self.api).encode()
        if name in CONTROL:
            if given is not None and hmac.compare_digest(given, admin):
                return None
            if given is not None and hmac.compare_digest(given, api):
                return 403, f"/{name} needs the admin key (areal serve --admin-key), not the API key"
            return 401, "a valid key is required: Authorization: Bearer KEY"
        if given is not None and (hmac.compare_digest(given, api) or hmac.compare_digest(given, admin)):
            return None
        return 401, "a valid API key is required: Authorization: Bearer KEY"

    def proof_headers(self, nonce: str | None, port: int | None) -> dict[str, str] | None:
        """The header that answers a /health challenge: proof(API key, nonce, port), `port` the one the
        request came in on (so that another server of the run cannot relay it); none without a key (or a
        port, or with a challenge that is too long, or not text)."""
        if self.api is None or nonce is None or port is None:
            return None
        if len(nonce) > MAX_NONCE or _utf8(nonce) is None:
            return None
        return {PROOF_HEADER: proof(self.api, nonce, port)}


def _listening_port(request: web.Request) -> int | None:
    """The port of the socket `request` came in on (this server's own), None when it is unknown."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return sockname[1] if isinstance(sockname, tuple) and len(sockname) >= 2 else None


class Throttled:
    """Log lines that a client can cause (refusals): at most one per `every_s` seconds, the next one
    saying how many were left out, so that a client without a key cannot grow the log without bound."""

    def __init__(self, log: logging.Logger, every_s: float = 5.0):
        self.log, self.every_s = log, every_s
        self._last, self._skipped = -math.inf, 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._skipped += 1
            return
        if self._skipped:
            message += f" ({self._skipped} more not logged in the {now - self._last:.0f} s before)"
        self._last, self._skipped = now, 0
        self.log.warning(message, *args)


@dataclasses.dataclass
class _Conn:
    opened: float
    last: float  # when its last request ended (or it opened)
    busy: int = 0  # requests being handled
    started: int = 0  # requests started
    connecting: bool = True  # counted before it connects (ConnectionGuard.opened)


class ConnectionGuard:
    """The server's open connections: at most `cap` (kept below the process's file limit, so that accepting
    never runs out of files); a connection that starts no request within `first_request_s` of opening,
    or stays idle `idle_s` after one, is closed; at the cap, the longest-idle one is closed to make room
    for the next (when every one is busy, accepting waits for one to finish)."""

    def __init__(self, cap: int, first_request_s: float = 5.0, idle_s: float = 60.0):
        self.cap, self.first_request_s, self.idle_s = cap, first_request_s, idle_s
        self.conns: dict[Any, _Conn] = {}  # aiohttp's RequestHandler -> its state
        self.closed = 0  # connections closed for being idle
        self._freed: asyncio.Event | None = None

    def opened(self, handler: Any) -> None:
        """Count `handler`'s connection, from before it connects (then `connected`, or `forget`)."""
        now = time.monotonic()
        self.conns[handler] = _Conn(now, now)

    def connected(self, handler: Any) -> None:
        """`handler` is connected: once its transport is gone, it is forgotten (`_prune`)."""
        c = self.conns.get(handler)
        if c is not None:
            c.connecting = False

    def forget(self, handler: Any) -> None:
        """`handler` never connected."""
        self.conns.pop(handler, None)

    def begin(self, handler: Any) -> None:
        c = self.conns.get(handler)
        if c is not None:
            c.busy += 1
            c.started += 1

    def end(self, handler: Any) -> None:
        c = self.conns.get(handler)
        if c is not None:
            c.busy -= 1
            c.last = time.monotonic()
        if self._freed is not None:
            self._freed.set()

    def _prune(self) -> None:
        """Forget the connections that are gone (not those still connecting: no transport yet either)."""
        gone = [h for h, c in self.conns.items() if h.transport is None and not c.connecting]
        for h in gone:
            del self.conns[h]

    def _close(self, handler: Any) -> None:
        self.conns.pop(handler, None)
        self.closed += 1
        handler.force_close()

    def sweep(self) -> None:
        """Close the connections idle too long: never started a request, or none for `idle_s`."""
        self._prune()
        now = time.monotonic()
        for h, c in list(self.conns.items()):
            if c.busy:
                continue
            if (c.started == 0 and now - c.opened > self.first_request_s) or now - c.last > self.idle_s:
                self._close(h)

    async def room(self) -> None:
        """Return once one more connection fits under the cap (closing the longest-idle one if need be)."""
        if self._freed is None:
            self._freed = asyncio.Event()
        while True:
            self._prune()
            if len(self.conns) < self.cap:
                return
            idle = [(c.last, i, h) for i, (h, c) in enumerate(self.conns.items()) if not c.busy]
            if idle:
                self._close(min(idle)[2])
                continue
            self._freed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._freed.wait(), 1.0)


ACCEPT_ERRORS = Throttled(logger, 10.0)


async def accept_loop(sock: socket.socket, factory, guard: ConnectionGuard) -> None:
    """Accept connections one at a time, each only once the guard has room for it; `factory()` makes the
    protocol (aiohttp's request handler) of each. (asyncio's own accepting takes every pending connection
    at once, beyond any file limit, and then stops for a second.)"""
    sock.setblocking(False)
    while True:
        try:
            await _accept_one(sock, factory, guard)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # out of files or memory (something else holds them), or a bug: go on shortly
            ACCEPT_ERRORS.warning("cannot accept a connection: %s: %s", type(e).__name__, e)
            await asyncio.sleep(0.5)


async def _accept_one(sock: socket.socket, factory, guard: ConnectionGuard) -> None:
    loop = asyncio.get_running_loop()
    await guard.room()
    try:
        conn, _ = await loop.sock_accept(sock)
    except (ConnectionAbortedError, InterruptedError):
        return
    handler = factory()
    guard.opened(handler)  # before it connects: its first request may begin at once
    try:
        conn.setblocking(False)
        await loop.connect_accepted_socket(lambda: handler, conn)
    except OSError:
        guard.forget(handler)
        conn.close()
        return
    guard.connected(handler)


def connection_cap(wanted: int, reserve: int = 16) -> int:
    """`wanted`, lowered to what the open-file limit leaves: the limit less the files open now and
    `reserve` (weight updates open files too). The soft limit is first raised as far as the hard one allows
    (to 65536 at most)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < top:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
            soft = top
    if soft == resource.RLIM_INFINITY:
        return wanted
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 64
    room = soft - open_now - reserve
    if room < wanted:
        logger.warning(
            "serving at most %d connections at once: the open-file limit (ulimit -n) is %d",
            max(1, room),
            soft,
        )
    return max(1, min(wanted, room))


def make_app(
    service: GenerationService,
    max_body_mb: int = 16,
    keys: Keys | None = None,
    guard: ConnectionGuard | None = None,
    max_requests: int = 1024,
) -> web.Application:
    """The routes, behind the key check; at most `max_requests` requests in flight (429 beyond) on the
    endpoints that are neither open nor control ones. `guard` (if any) learns when connections are busy."""
    keys = keys or Keys()
    refusals = Throttled(logger)
    in_flight = [0]

    def route(name: str):
        method, parse = getattr(service, name), service.PARSERS.get(name)
        counted = name not in OPEN and name not in CONTROL

        async def handle(request: web.Request) -> web.StreamResponse:
            refused = keys.refusal(name, request.headers.get("Authorization"))
            if refused is not None:  # logged without the key, at most once every few seconds
                refusals.warning("%s %s from %s: %s", refused[0], request.path, request.remote, refused[1])
                return _error(*refused)
            if name in OPEN:
                status, payload = await method({})
                challenge = request.headers.get(CHALLENGE_HEADER)
                return _respond(status, payload, keys.proof_headers(challenge, _listening_port(request)))
            if counted and in_flight[0] >= max_requests:
                return _error(
                    429,
                    f"the server has {in_flight[0]} requests in flight, its limit (areal serve --max-requests); "
                    "try again later",
                )
            in_flight[0] += counted
            try:
                return await answer(request, method, parse)
            finally:
                in_flight[0] -= counted

        return handle

    async def answer(request: web.Request, method, parse) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(
                413,
                f"the body is larger than this server's limit of {max_body_mb} MiB (areal serve --max-body-mb)",
            )
        try:
            if len(raw) > INLINE_BODY_BYTES:  # its checks walk every token id: off the loop, in one hop
                body = await asyncio.to_thread(read_body, raw, parse)
            else:
                body = read_body(raw, parse)
            status, payload = await method(body)
            if isinstance(payload, EventStream):  # streamed (OpenAI's stream: true)
                return await payload.send(request)
            return _respond(status, payload)
        except (ProtocolError, ValueError) as e:
            return _error(400, str(e))
        except Exception as e:  # a bug or a device error: the client sees it, the server keeps serving
            traceback.print_exc()
            return _error(500, f"{type(e).__name__}: {e}")

    middlewares = []
    if guard is not None:

        @web.middleware
        async def busy(request: web.Request, handler) -> web.StreamResponse:
            guard.begin(request.protocol)
            try:
                return await handler(request)
            finally:
                guard.end(request.protocol)

        middlewares.append(busy)
    app = web.Application(client_max_size=max_body_mb << 20, middlewares=middlewares)
    for method, path, name in ROUTES:
        app.router.add_route(method, path, route(name))
    return app


def _below(path: str, root: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(root).resolve())


class GenerationServer:
    """A bound socket, the service behind it, and the loop that serves it (`serve_forever`)."""

    def __init__(
        self,
        service: GenerationService,
        sock: socket.socket,
        log_requests: bool,
        max_body_mb: int = 16,
        keys: Keys | None = None,
        max_connections: int = 1024,
        max_requests: int = 1024,
    ):
        self.service, self.sock, self.log_requests = service, sock, log_requests
        self.max_body_mb, self.keys = max_body_mb, keys
        self.max_connections, self.max_requests = max_connections, max_requests

    @property
    def server_address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    async def _serve(self, on_ready) -> None:
        if self.log_requests:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        access_log = logging.getLogger("aiohttp.access") if self.log_requests else None
        guard = ConnectionGuard(connection_cap(self.max_connections))
        app = make_app(self.service, self.max_body_mb, self.keys, guard, self.max_requests)
        # aiohttp's own keep-alive timeout only backs the guard's up
        runner = web.AppRunner(app, access_log=access_log, keepalive_timeout=guard.idle_s + 15)
        await runner.setup()
        server = runner.server
        assert server is not None
        accepting = asyncio.create_task(accept_loop(self.sock, server, guard))
        sweeping = asyncio.create_task(_every(1.0, guard.sweep))
        if on_ready is not None:
            on_ready(*self.server_address)
        try:
            await asyncio.Event().wait()  # until cancelled (Ctrl-C) or killed
        finally:
            self.service.shutting_down = True
            self.service.scheduler.stop()
            for task in (accepting, sweeping):
                task.cancel()
            await runner.cleanup()
            self.service.close()

    def serve_forever(self, on_ready=None) -> None:
        """Answer requests until Ctrl-C (KeyboardInterrupt); `on_ready(host, port)` once listening."""
        try:
            asyncio.run(self._serve(on_ready))
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()


async def _every(seconds: float, fn) -> None:
    """fn() every `seconds` seconds, whatever it raises (logged)."""
    while True:
        await asyncio.sleep(seconds)
        try:
            fn()
        except Exception:
            logger.exception("%s failed", getattr(fn, "__name__", fn))


def make_server(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    device: str = "auto",
    dtype: str = "float32",
    batch_window_ms: float = 5.0,
    max_batch_size: int = 256,
    weight_version: str = "default",
    log_requests: bool = False,
    max_n: int = 64,
    max_body_mb: int = 16,
    keys: Keys | None = None,
    weights_dir: str | None = None,
    max_connections: int = 1024,
    max_requests: int = 1024,
    adapters: list[tuple[str, str]] | None = None,
    tool_format: str | None = None,
) -> GenerationServer:
    """Bind the socket (port 0 = any free port), then load the model (and the LoRA `adapters`, (name,
    folder) each) and start the batching loop. The port is held from the start: no other process can take
    it while the model loads (connections made meanwhile wait in the listen queue, and are answered once
    the server runs)."""
    try:
        sock = socket.create_server((host, port), backlog=1024)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        runner = ModelRunner(model_path, device, dtype)
        for name, folder in adapters or []:
            runner.load_adapter(name, folder)
    except BaseException:
        sock.close()
        raise
    scheduler = Scheduler(runner, batch_window_ms / 1000, max_batch_size, weight_version, continuous=True)
    scheduler.start()
    # What exists now (the model, torch, transformers: ~400k objects) lives as long as the server: out
    # of the collector's reach, a full collection walks only requests' objects. Walking them all took
    # 0.3-0.5 s per full collection under load, during which neither thread runs.
    gc.collect()
    gc.freeze()
    service = GenerationService(runner, scheduler, max_n, weights_dir)
    service.tool_format = tool_format
    return GenerationServer(
        service,
        sock,
        log_requests,
        max_body_mb,
        keys,
        max_connections,
        max_requests,
    )


# Fault injection for the fault-matrix tests: `AREALCLI_FAULT_DIE_ON_UPDATE=N:MARKER` makes the server kill
# itself (SIGKILL) in its Nth weight update, once (MARKER, a file, records that it happened).
_UPDATES = [0]


def _injected_death_on_update() -> None:
    spec = os.environ.get("AREALCLI_FAULT_DIE_ON_UPDATE")
    if not spec:
        return
    at, _, marker = spec.partition(":")
    _UPDATES[0] += 1
    if _UPDATES[0] == int(at) and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
