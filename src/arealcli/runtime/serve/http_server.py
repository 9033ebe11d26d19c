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

One event-loop thread serves every connection (no thread per connection: on a busy CPU, handing requests
between many threads costs more than generating) and does all per-request work: JSON, tokenizing,
detokenizing, responses. The scheduler's thread only runs the model and sampling (continuous batching:
requests join the running batch between decoding steps), and wakes the waiting requests through the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import json
import logging
import os
import signal
import socket
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from arealcli.runtime.generation.model_runner import ModelRunner
from arealcli.runtime.generation.sampling import StopTexts
from arealcli.runtime.generation.scheduler import Scheduler, Sequence
from arealcli.runtime.wire.auth import key_of
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
    streamable,
    usage,
)
from arealcli.runtime.wire.sglang import ProtocolError, generate_response, parse_generate

logger = logging.getLogger(__name__)


class GenerationService:
    """The endpoints, as methods: body (parsed JSON) -> (status, JSON payload, or text when a str)."""

    def __init__(
        self, runner: ModelRunner, scheduler: Scheduler, max_n: int = 64, weights_dir: str | None = None
    ):
        self.runner, self.scheduler = runner, scheduler
        self.max_n = max_n  # samples per prompt in one request
        self.weights_dir = weights_dir  # /update_weights_from_disk loads only from below it (when set)
        self.served_model_name = runner.model_path
        self.tokenizer_path = runner.tokenizer_path
        self.shutting_down = False

    async def generate(self, body: Any) -> tuple[int, Any]:
        t0 = time.perf_counter()
        req = parse_generate(body)
        self._check_size(len(req.prompts), req.sampling[0].n)
        r = self.runner
        per_prompt: list[list[Sequence]] = []
        for prompt, sampling, rid in zip(req.prompts, req.sampling, req.rids, strict=True):
            ids = prompt if isinstance(prompt, list) else r.encode(prompt)
            if not ids:
                raise ProtocolError("a prompt encodes to no tokens; give at least one")
            if sampling.stop and r.tokenizer is None:
                raise ProtocolError(
                    f"{r.model_path} has no tokenizer: stop texts need one (use stop_token_ids)"
                )
            if max(ids) >= r.vocab_size:
                raise ProtocolError(f"token id {max(ids)} is out of the vocabulary (size {r.vocab_size})")
            if len(ids) >= r.context_length:
                raise ProtocolError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({r.context_length} tokens)."
                )
            max_new = min(sampling.max_new_tokens, r.context_length - len(ids))
            rids = [rid] if sampling.n == 1 else [f"{rid}-{j}" for j in range(sampling.n)]
            per_prompt.append([Sequence(x, ids, sampling, max_new) for x in rids])
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

    def _prompt_ids(self, prompt: list[int] | str, room: int = 1) -> list[int]:
        """A prompt's token ids, checked; `room`: the context positions it must leave for generation."""
        r = self.runner
        ids = prompt if isinstance(prompt, list) else r.encode(prompt)
        if not ids:
            raise ProtocolError("a prompt encodes to no tokens; give at least one")
        if max(ids) >= r.vocab_size or min(ids) < 0:
            raise ProtocolError(f"token id {max(ids)} is out of the vocabulary (size {r.vocab_size})")
        if len(ids) > r.context_length - room:
            raise ProtocolError(
                f"the prompt ({len(ids)} tokens) leaves no room in the model's context ({r.context_length} tokens)"
            )
        return ids

    def _render_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
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
        return self._prompt_ids(tok.encode(rendered, add_special_tokens=False))

    async def _openai(self, req: OpenAIRequest) -> tuple[int, Any]:
        """Every prompt's n choices, whole or streamed (`EventStream`); every sample runs as its own task
        (submitted together: they batch), continued on the new weights when a weight update aborts it."""
        r = self.runner
        self._check_size(len(req.prompts), req.sampling.n)
        if req.top_logprobs and r.tokenizer is None:
            raise ProtocolError(f"{r.model_path} has no tokenizer: top log-probs are keyed by token text")
        room = 0 if req.sampling.max_new_tokens == 0 else 1  # echo with max_tokens 0: only scored
        prompts = [self._prompt_ids(p, room) for p in req.prompts]
        samples = [
            _Sample(ids, min(req.sampling.max_new_tokens, r.context_length - len(ids)))
            for ids in prompts
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
        return 200, completion_response(req, choices, self.served_model_name, sum(len(p) for p in prompts))

    async def _sample(self, s: _Sample, req: OpenAIRequest) -> None:
        """Generate one choice into `s` (its error in s.error); a sample aborted by a weight update is
        continued on the new weights, one aborted by `_abandon` is not."""
        for _ in range(100):  # each round: what is left after an abort
            left = s.max_new - len(s.out)
            if left <= 0 or s.cancelled:
                if not s.versions:
                    s.versions.append(self.scheduler.weight_version)
                if left <= 0:
                    s.finish = "length" if s.finish == "abort" else s.finish
                return
            sampling = req.sampling
            if s.out:
                sampling = dataclasses.replace(
                    sampling, min_new_tokens=max(0, sampling.min_new_tokens - len(s.out))
                )
            seq = Sequence(f"oai-{id(s):x}", s.prompt + s.out, sampling, left, top_n=req.top_logprobs)
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
            self.scheduler.score, [(ids, 1) for ids in prompts], req.top_logprobs
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
        )

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
        created, model, n = int(time.time()), self.served_model_name, req.sampling.n
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

    async def completions(self, body: Any) -> tuple[int, Any]:
        return await self._openai(parse_completion_request(body))

    async def chat_completions(self, body: Any) -> tuple[int, Any]:
        tok = self.runner.tokenizer
        template = getattr(tok, "chat_template", None) if tok is not None else None
        return await self._openai(parse_chat_request(body, self._render_chat, template))

    async def models(self, body: Any) -> tuple[int, Any]:
        return 200, models_response(self.served_model_name)

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
        ok, message = await asyncio.to_thread(  # waits for the running batch: off the event loop
            self.scheduler.update_weights,
            body["model_path"],
            None if version is None else str(version),
            bool(body.get("abort_all_requests")),
        )
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
        if sleep is not None and (isinstance(sleep, bool) or not isinstance(sleep, int | float) or sleep < 0):
            raise ProtocolError(f"forward_sleep_time must be a non-negative number or null (got {sleep!r})")
        self.scheduler.forward_sleep_s = float(sleep or 0.0)
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
            "has_image_understanding": False,
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
            "internal_states": [dict(sch.stats)],  # forward passes, samples, tokens so far
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
]


def _respond(status: int, payload: Any) -> web.Response:
    if isinstance(payload, str):
        return web.Response(status=status, text=payload)
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type="application/json")


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


# Endpoints that change what the server does for everyone: the admin key (when set) guards them.
CONTROL = {"update_weights_from_disk", "abort_request", "slow_down", "flush_cache"}
OPEN = {"health"}  # answered without a key (liveness probes)


@dataclasses.dataclass(frozen=True)
class Keys:
    """Who may call: `api` for every endpoint but /health, `admin` (default: the API key) for CONTROL."""

    api: str | None = None
    admin: str | None = None

    def refusal(self, name: str, header: str | None) -> tuple[int, str] | None:
        """(401 or 403, why) when a request with Authorization `header` may not call endpoint `name`."""
        if self.api is None or name in OPEN:
            return None
        given = key_of(header)
        admin = self.admin or self.api
        if name in CONTROL:
            if given is not None and hmac.compare_digest(given.encode(), admin.encode()):
                return None
            if given is not None and hmac.compare_digest(given.encode(), self.api.encode()):
                return 403, f"/{name} needs the admin key (areal serve --admin-key), not the API key"
            return 401, "a valid key is required: Authorization: Bearer KEY"
        if given is not None and (
            hmac.compare_digest(given.encode(), self.api.encode())
            or hmac.compare_digest(given.encode(), admin.encode())
        ):
            return None
        return 401, "a valid API key is required: Authorization: Bearer KEY"


def make_app(service: GenerationService, max_body_mb: int = 16, keys: Keys | None = None) -> web.Application:
    keys = keys or Keys()

    def route(name: str):
        method = getattr(service, name)

        async def handle(request: web.Request) -> web.StreamResponse:
            refused = keys.refusal(name, request.headers.get("Authorization"))
            if refused is not None:  # logged without the key
                logger.warning("%s %s from %s: %s", refused[0], request.path, request.remote, refused[1])
                return _respond(refused[0], {"error": {"message": refused[1]}})
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return _respond(
                    413,
                    {
                        "error": {
                            "message": f"the body is larger than this server's limit of {max_body_mb} MiB "
                            "(areal serve --max-body-mb)"
                        }
                    },
                )
            try:
                body = json.loads(raw) if raw.strip() else {}
            except ValueError as e:
                return _respond(400, {"error": {"message": f"the body is not valid JSON: {e}"}})
            except RecursionError:
                body = _TOO_DEEP
            if body is _TOO_DEEP or _too_deep(body, raw):
                return _respond(
                    400,
                    {"error": {"message": f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep"}},
                )
            try:
                status, payload = await method(body)
                if isinstance(payload, EventStream):  # streamed (OpenAI's stream: true)
                    return await payload.send(request)
                return _respond(status, payload)
            except (ProtocolError, ValueError) as e:
                return _respond(400, {"error": {"message": str(e)}})
            except Exception as e:  # a bug or a device error: the client sees it, the server keeps serving
                traceback.print_exc()
                return _respond(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

        return handle

    app = web.Application(client_max_size=max_body_mb << 20)
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
    ):
        self.service, self.sock, self.log_requests = service, sock, log_requests
        self.max_body_mb, self.keys = max_body_mb, keys

    @property
    def server_address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    async def _serve(self, on_ready) -> None:
        if self.log_requests:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        access_log = logging.getLogger("aiohttp.access") if self.log_requests else None
        runner = web.AppRunner(make_app(self.service, self.max_body_mb, self.keys), access_log=access_log)
        await runner.setup()
        await web.SockSite(runner, self.sock, backlog=1024).start()
        if on_ready is not None:
            on_ready(*self.server_address)
        try:
            await asyncio.Event().wait()  # until cancelled (Ctrl-C) or killed
        finally:
            self.service.shutting_down = True
            self.service.scheduler.stop()
            await runner.cleanup()

    def serve_forever(self, on_ready=None) -> None:
        try:
            asyncio.run(self._serve(on_ready))
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()


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
) -> GenerationServer:
    """Load the model, bind the socket (port 0 = any free port) and start the batching loop."""
    runner = ModelRunner(model_path, device, dtype)
    try:
        sock = socket.create_server((host, port), backlog=1024)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    scheduler = Scheduler(runner, batch_window_ms / 1000, max_batch_size, weight_version, continuous=True)
    scheduler.start()
    # What exists now (the model, torch, transformers: ~400k objects) lives as long as the server: out
    # of the collector's reach, a full collection walks only requests' objects. Walking them all took
    # 0.3-0.5 s per full collection under load, during which neither thread runs.
    gc.collect()
    gc.freeze()
    return GenerationServer(
        GenerationService(runner, scheduler, max_n, weights_dir), sock, log_requests, max_body_mb, keys
    )


def serve_forever(server: GenerationServer, on_ready=None) -> None:
    server.serve_forever(on_ready)


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
