"""Workflows written against OpenAI's client interface.

An agent is ordinary code that talks to a model through `client.completions.create(...)` or
`client.chat.completions.create(...)`, as with the `openai` package — the same code runs against
`areal serve`'s `/v1` endpoints. A workflow subclasses `AgentWorkflow` and writes one episode:

    class CalculatorAgent(AgentWorkflow):
        def episode(self, client, prompt: str) -> None:
            call = client.completions.create(model="policy", prompt=prompt, max_tokens=12, stop="]")
            ...

During training the client is in-process: every episode of a batch runs in a thread of its own, and
their requests are gathered until every running episode waits on one (no timing involved), then sent
as one batched generate call on the engine (in episode order: deterministic). Each request is recorded
with its token ids and log-probs, and the episode becomes one trained sequence: the last request's
prompt and completion, with `loss_mask` True on every token a request generated. So each request must
extend the previous one (its prompt starts with the previous prompt and completion); what an agent
inserts in between (tool output, a user turn) never trains. The first request's prompt is the episode's
prompt: the dataset's prompt text, or what the agent makes of it (a chat agent puts it in a user
message, rendered with the chat template).

The sampling settings are the recipe's (`generation`): the recorded log-probs must be the policy's,
so a request asking for another temperature, top_p or top_k is refused; `max_tokens` is capped by the
recipe's `max_new_tokens` and the episode's `max_total_tokens`; `stop` texts (any length) end a request
at the token that completes them and, as with OpenAI, are not part of the returned text (`stop_reason`
names the one matched; `token_ids` keep every generated token).

Function calling works as on `areal serve`: `tools` are rendered by the chat template, calls in the
template's format (wire/tool_calls.py) come back as `message.tool_calls`, and the agent appends the
message and `{"role": "tool", ...}` results as usual. When the template renders the model's last reply
otherwise than the model wrote it (a call's JSON spaced differently, say), the reply stays as the
model's own tokens and only the template's text after it is added: the trained sequence is what the
model generated and saw.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from arealcli.errors import UserError
from arealcli.runtime.agents.workflows import Episode
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.wire.openai import (
    OfferedTools,
    ProtocolError,
    chat_message,
    finish_of,
    parse_tools,
)
from arealcli.runtime.wire.tool_calls import call_text
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
from arealcli.schema.components.workflows import AgentArgs

# --------------------------------------------------------------------------- response objects


@dataclass
class Logprobs:
    tokens: list[str]
    token_logprobs: list[float]
    content: list[dict[str, Any]] = field(default_factory=list)  # chat: [{token, logprob}]


@dataclass
class Function:
    name: str
    arguments: str  # JSON text, as OpenAI's


@dataclass
class ToolCall:
    id: str
    function: Function
    type: str = "function"


@dataclass
class Message:
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | None = None


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str  # stop | length
    token_ids: list[int]
    prompt_token_ids: list[int]
    logprobs: Logprobs | None
    message: Message | None = None
    stop_reason: Any = None  # the matched stop text (not part of `text`) or stop token id


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class Completion:
    choices: list[Choice]
    usage: Usage
    object: str = "text_completion"


# --------------------------------------------------------------------------- batching


class _Batcher:
    """Gathers the requests of concurrently running episodes into batched generate calls."""

    def __init__(self, engine, tokenizer, running: int, timeout_s: float = float("inf")):
        self.engine, self.tokenizer = engine, tokenizer
        self.cv = threading.Condition()
        self.pending: list[tuple[int, list[int], GenerationHyperparameters, dict]] = []
        self.running, self.episodes = running, running
        self.done: set[int] = set()
        self.timeout_s = timeout_s
        self.progress = time.monotonic()  # when an episode last asked the model, finished, or got an answer

    def request(self, episode: int, prompt: list[int], g: GenerationHyperparameters) -> tuple:
        slot: dict = {}
        with self.cv:
            self.pending.append((episode, prompt, g, slot))
            self.progress = time.monotonic()
            self.cv.notify_all()
            while "out" not in slot:
                self.cv.wait()
        if isinstance(slot["out"], BaseException):
            raise slot["out"]
        return slot["out"]

    def finished(self, episode: int) -> None:
        with self.cv:
            self.running -= 1
            self.done.add(episode)
            self.progress = time.monotonic()
            self.cv.notify_all()

    def _stuck(self) -> None:
        waiting = {item[0] for item in self.pending}
        stuck = [i for i in range(self.episodes) if i not in self.done and i not in waiting]
        raise UserError(
            f"agent episode(s) {stuck} neither asked the model nor finished for {self.timeout_s:g} s "
            "(a tool or an agent that hangs?); give them longer with the workflow's episode_timeout_s"
        )

    def serve(self) -> None:
        """Run in the calling thread until every episode has finished; an episode that neither asks the
        model nor finishes for `timeout_s` stops it with an error."""
        while True:
            with self.cv:
                while self.running > 0 and len(self.pending) < self.running:
                    left = self.progress + self.timeout_s - time.monotonic()
                    if left <= 0:
                        self._stuck()
                    self.cv.wait(min(left, 3600.0))
                if self.running == 0 and not self.pending:
                    return
                batch, self.pending = sorted(self.pending, key=lambda r: r[0]), []
            groups: dict[str, list] = {}
            for item in batch:  # one generate call per distinct setting (usually one)
                groups.setdefault(item[2].model_dump_json(), []).append(item)
            for items in groups.values():
                try:
                    data = SequenceSample.from_lists(
                        list(range(len(items))), {"packed_prompts": [torch.tensor(i[1]) for i in items]}
                    )
                    out = self.engine.generate(data, MicroBatchSpec(), self.tokenizer, items[0][2])
                    results: list = [
                        (out.output_ids[j], out.logprobs[j], out.no_eos[j], _versions(out, j))
                        for j in range(len(items))
                    ]
                except BaseException as e:  # handed to every waiting episode, and raised there
                    results = [e] * len(items)
                with self.cv:
                    for item, result in zip(items, results, strict=True):
                        item[3]["out"] = result
                    self.progress = time.monotonic()  # the agents' time starts when they have the answers
                    self.cv.notify_all()


def _versions(out, j: int) -> tuple[int | None, int | None]:
    first = out.versions[j] if out.versions is not None else None
    last = out.last_versions[j] if out.last_versions is not None else first
    return first, last


# --------------------------------------------------------------------------- the client


class _Completions:
    def __init__(self, client: AgentClient, chat: bool):
        self.client, self.chat = client, chat

    def create(self, **kwargs: Any) -> Completion:
        return self.client._create(self.chat, kwargs)


class _Chat:
    def __init__(self, client: AgentClient):
        self.completions = _Completions(client, chat=True)


@dataclass
class Request:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    no_eos: bool
    versions: tuple[int | None, int | None]
    rendered: str | None = None  # chat: the template's text the prompt stands for


_SAMPLING = {"temperature", "top_p", "top_k"}
_ACCEPTED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stop", "n", "logprobs"}
_TOOLS = {"tools", "tool_choice", "parallel_tool_calls"}


class AgentClient:
    """The in-process client one episode talks through (OpenAI's `completions` and `chat.completions`)."""

    def __init__(self, batcher: _Batcher, index: int, prompt_ids: list[int], gconfig, args: AgentArgs):
        self._batcher, self._index, self._gconfig, self._args = batcher, index, gconfig, args
        self._tokenizer = batcher.tokenizer
        self.prompt_ids = prompt_ids
        self.requests: list[Request] = []
        self.tool_calls = self.tool_errors = 0  # what `record_tool` counted
        self.completions = _Completions(self, chat=False)
        self.chat = _Chat(self)

    def _sampling_check(self, kwargs: dict) -> None:
        g = self._gconfig
        recipe = {
            "temperature": 0.0 if g.greedy else g.temperature,
            "top_p": g.top_p,
            "top_k": g.top_k if g.top_k > 0 else -1,
        }
        for key in _SAMPLING & set(kwargs):
            asked = kwargs[key]
            same = asked is None or (key == "top_k" and asked in (-1, 0) and recipe[key] == -1)
            same = same or asked == recipe[key] or (key == "temperature" and g.greedy and asked == 0)
            if not same:
                raise UserError(
                    f"an agent asked for {key}={asked!r}; while training, sampling follows the recipe's "
                    f"generation ({key}={recipe[key]!r}) so that the recorded log-probs are the policy's"
                )
        unknown = sorted(set(kwargs) - _SAMPLING - _ACCEPTED - _TOOLS)
        if unknown:
            raise UserError(f"the in-process agent client does not support {unknown}")
        if kwargs.get("n", 1) != 1:
            raise UserError("an episode is one trajectory: its requests have n = 1")

    def _stop_texts(self, stop: Any) -> tuple[str, ...]:
        texts = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(t, str) and t for t in texts):
            raise UserError(f"an agent's stop must be a text or a list of non-empty texts (got {stop!r})")
        return tuple(dict.fromkeys(texts))

    def _tools(self, chat: bool, kwargs: dict) -> OfferedTools:
        if not chat:
            if set(kwargs) & _TOOLS:
                raise UserError("tools are offered through chat.completions")
            return OfferedTools()
        try:
            return parse_tools(kwargs, getattr(self._tokenizer, "chat_template", None))
        except ProtocolError as e:
            raise UserError(f"an agent's request: {e}") from None

    def _render(
        self, chat: bool, kwargs: dict, tools: list[dict] | None, start: str = ""
    ) -> tuple[list[int], str | None]:
        """The prompt's token ids, and for chat the template's text they stand for (`start`, the start of a
        tool call written for the model, after its generation prompt)."""
        tok = self._tokenizer
        messages = None
        if chat:
            if not getattr(tok, "chat_template", None):
                raise UserError("chat.completions needs a tokenizer with a chat template")
            try:
                messages = [chat_message(m, i) for i, m in enumerate(kwargs.get("messages") or [])]
            except ProtocolError as e:
                raise UserError(f"an agent's request: {e}") from None
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            text += start
        else:
            text = kwargs["prompt"]
            if isinstance(text, list):
                return list(text), None

        # Text that continues an earlier request keeps that request's tokens (the model's own: re-encoding
        # generated text may split it differently); only the new text is encoded.
        # A conversation that goes on from the last reply, rendered otherwise than the model wrote it, keeps
        # the reply's tokens too (`_spliced`) before it is taken as a new turn after the episode's prompt.
        def extended(ids: list[int]) -> list[int] | None:
            before = tok.decode(ids)
            if not text.startswith(before):
                return None
            rest = text[len(before) :]
            return ids + (tok(rest, add_special_tokens=False)["input_ids"] if rest else [])

        for r in reversed(self.requests):
            found = extended(r.prompt_ids + r.output_ids)
            if found is not None:
                return found, text
        spliced = self._spliced(messages, tools, text) if messages else None
        if spliced is not None:
            return spliced, text
        found = extended(self.prompt_ids)
        if found is not None:
            return found, text
        return tok(text, add_special_tokens=False)["input_ids"], text

    def _spliced(self, messages: list[dict], tools, text: str) -> list[int] | None:
        """When the template renders the model's last reply differently from how the model wrote it
        (a tool call's JSON spaced otherwise, say), that reply stands as the model's own tokens: the
        previous prompt and completion, then the template's text after the reply (its end of turn,
        the tool results, the next generation prompt). None when the conversation does not line up
        with the previous request (it is then encoded as a new prompt, and refused for training)."""
        if not self.requests or self.requests[-1].rendered is None:
            return None
        last, tok = self.requests[-1], self._tokenizer
        k = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if k is None:
            return None

        def render(upto: int, generation_prompt: bool) -> str:
            return tok.apply_chat_template(
                messages[:upto], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )

        head, through = render(k, True), render(k + 1, False)
        # the last prompt may hold the start of a tool call written for the model after `head`
        rendered = last.rendered or ""
        if not rendered.startswith(head) or not through.startswith(head) or not text.startswith(through):
            return None
        turn = through[len(head) :]  # the reply as the template writes it, with its end of turn
        ended = bool(last.output_ids) and not last.no_eos
        end = tok.decode(last.output_ids[-1:]) if ended else (tok.eos_token or "")
        at = turn.rfind(end) if end else -1
        closing = "" if at < 0 else turn[at + len(end) :] if ended else turn[at:]
        rest = closing + text[len(through) :]
        return last.prompt_ids + last.output_ids + tok(rest, add_special_tokens=False)["input_ids"]

    def _create(self, chat: bool, kwargs: dict) -> Completion:
        self._sampling_check(kwargs)
        a, g = self._args, self._gconfig
        offered = self._tools(chat, kwargs)
        prompt, rendered = self._render(chat, kwargs, offered.tools, offered.start)
        if len(self.requests) >= a.max_requests:
            raise UserError(f"an episode made more than max_requests={a.max_requests} requests")
        used = len(prompt) - len(self.prompt_ids)
        asked = kwargs.get("max_completion_tokens") or kwargs.get("max_tokens") or g.max_new_tokens
        budget = min(asked, g.max_new_tokens, a.max_total_tokens - used)
        stop_texts = self._stop_texts(kwargs.get("stop"))
        if budget > 0:
            stop = list(dict.fromkeys([*g.stop, *stop_texts]))
            step = g.model_copy(update={"n": 1, "max_new_tokens": budget, "min_new_tokens": 0, "stop": stop})
            ids, lps, no_eos, versions = self._batcher.request(self._index, prompt, step)
            ids, lps = list(ids), list(lps)
        else:  # the episode's token budget is spent
            ids, lps, no_eos, versions = [], [], True, (None, None)
        self.requests.append(Request(prompt, ids, lps, no_eos, versions, rendered))
        tok = self._tokenizer
        reason, stopped_by, text = finish_of(
            ids,
            "length" if no_eos else "stop",
            lambda t: tok.decode(t, skip_special_tokens=True),
            (*stop_texts, *g.stop),
            g.stop_token_ids,
        )
        logprobs = None
        if kwargs.get("logprobs") is not None and kwargs.get("logprobs") is not False:
            pieces = [tok.decode([t]) for t in ids]
            logprobs = Logprobs(
                pieces, lps, [{"token": p, "logprob": lp} for p, lp in zip(pieces, lps, strict=True)]
            )
        message = Message(text) if chat else None
        if offered.tools and offered.format is not None:
            raw = call_text(
                ids, offered.start, tok.decode, lambda t: tok.decode(t, skip_special_tokens=False)
            )
            serial = len(self.requests) - 1
            content, calls = offered.format.parse(
                raw, offered.tools, offered.parallel, lambda k: f"{serial}_{k}"
            )
            if calls:
                message = Message(
                    content,
                    tool_calls=[
                        ToolCall(c["id"], Function(c["function"]["name"], c["function"]["arguments"]))
                        for c in calls
                    ],
                )
                reason = "tool_calls" if reason == "stop" else reason
        choice = Choice(0, text, reason, ids, prompt, logprobs, message, stopped_by)
        usage = Usage(len(prompt), len(ids), len(prompt) + len(ids))
        return Completion([choice], usage, "chat.completion" if chat else "text_completion")

    def record_tool(self, ok: bool) -> None:
        """Count a tool call the agent ran (and whether it failed) for the episode metrics; without any,
        every request after the first counts as one call."""
        self.tool_calls += 1
        self.tool_errors += not ok

    def episode(self) -> Episode:
        """The recorded requests as one trained sequence (after the episode's prompt)."""
        if not self.requests:
            raise UserError("an agent's episode made no request to the model")
        first = self.requests[0].prompt_ids  # the episode's prompt: the dataset's, or what the agent
        base = len(first)  # made of it (a chat agent renders the question with the chat template)
        for k, r in enumerate(self.requests[1:], start=1):
            before = self.requests[k - 1].prompt_ids + self.requests[k - 1].output_ids
            if r.prompt_ids[: len(before)] != before:
                raise UserError(
                    "an agent's requests must each extend the previous request's prompt and completion "
                    f"(one trained sequence per episode); request {k + 1} of {len(self.requests)} does not"
                )
        last = self.requests[-1]
        tokens = last.prompt_ids + last.output_ids
        mask = [False] * len(tokens)
        logprobs = [0.0] * len(tokens)
        for r in self.requests:
            end = len(r.prompt_ids) + len(r.output_ids)
            mask[len(r.prompt_ids) : end] = [True] * len(r.output_ids)
            logprobs[len(r.prompt_ids) : end] = r.logprobs
        versions = [v for r in self.requests for v in r.versions if v is not None]
        return Episode(
            prompt=None if first == self.prompt_ids else first,
            tokens=tokens[base:],
            mask=mask[base:],
            logprobs=logprobs[base:],
            no_eos=last.no_eos,
            turns=len(self.requests),
            tool_calls=self.tool_calls or len(self.requests) - 1,
            tool_errors=self.tool_errors,
            final=last.output_ids,
            versions=versions,
        )


class AgentWorkflow:
    """Base of workflows written against the OpenAI client interface: implement `episode(client, prompt)`.

    `Args` may extend `AgentArgs` (max_total_tokens, max_requests)."""

    Args = AgentArgs

    def __init__(self, args: AgentArgs):
        self.args = args

    def episode(self, client: AgentClient, prompt: str) -> None:
        raise NotImplementedError

    def run(
        self, engine, tokenizer, prompts: list[list[int]], gconfig: GenerationHyperparameters
    ) -> list[Episode]:
        batcher = _Batcher(engine, tokenizer, len(prompts), getattr(self.args, "episode_timeout_s", 600.0))
        clients = [AgentClient(batcher, i, p, gconfig, self.args) for i, p in enumerate(prompts)]
        errors: list[BaseException | None] = [None] * len(prompts)

        def play(i: int) -> None:
            try:
                self.episode(clients[i], tokenizer.decode(prompts[i]))
            except BaseException as e:  # raised in the trainer below, with the first episode's error
                errors[i] = e
            finally:
                batcher.finished(i)

        threads = [
            threading.Thread(target=play, args=(i,), name=f"agent-{i}", daemon=True)
            for i in range(len(prompts))
        ]
        for t in threads:
            t.start()
        batcher.serve()
        for t in threads:
            t.join()
        for e in errors:
            if e is not None:
                raise e
        return [c.episode() for c in clients]
