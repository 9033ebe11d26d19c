"""Episodes: generate, let the environment answer, append its tokens, continue — then one reward.

One episode of `tool_use`, for every prompt of a batch at once (each generation turn is one batched
generate call on the model's engine, a training engine or an inference engine alike):

    tokens = prompt
    repeat up to max_turns:
        model tokens <- generate(tokens), stopping at EOS or at `call_close`        (mask: True)
        if it stopped at `call_close`: result <- tool(text after the last `call_open`)
            tokens += result_template.format(result=result)                          (mask: False)
        else: the episode is over; its final answer is the model's text after the last tool result

The trained sequence keeps every token; the per-token mask (`loss_mask`) marks the model's own tokens,
so prompts and tool output never get gradient. Log-probs are the generating engine's (0 on tool tokens).
A workflow of your own: a class with `Args` and `run(engine, tokenizer, prompts, gconfig)` returning
`Episode`s, registered with `register_workflow(name, cls)`.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from arealcli.errors import DataError
from arealcli.runtime import vision
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.generation.sampling import StopTexts
from arealcli.runtime.tools import ToolError, ToolOutput, get_tool
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
from arealcli.schema.components.workflows import ToolUseArgs


def run_tool(tools: dict, name: str, arg, timeout_s: float = 60.0) -> tuple[str | ToolOutput, bool]:
    """(result, ok) of calling tool `name` of `tools` with `arg`: a text (or a `ToolOutput` with pictures,
    as the tool returned it), or JSON arguments (an
    object with one value passes that value; others pass as JSON text). Every failure is a result the
    model reads: no such tool, a ToolError, a bug in the tool itself, or no answer within `timeout_s`
    (the call is left to finish on its own thread; the run goes on)."""
    if isinstance(arg, dict) and len(arg) == 1:
        arg = next(iter(arg.values()))
    arg = arg if isinstance(arg, str) else json.dumps(arg)
    if name not in tools:
        return f"error: no tool {name!r} (tools: {', '.join(tools)})", False
    answer: list[tuple[str | ToolOutput, bool]] = []

    def call() -> None:
        try:
            out = tools[name](arg)
            answer.append((out if isinstance(out, ToolOutput) else str(out), True))
        except ToolError as e:
            answer.append((f"error: {e}", False))
        except Exception as e:
            answer.append((f"error: {type(e).__name__}: {e}", False))

    worker = threading.Thread(target=call, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return answer[0] if answer else (f"error: {name} gave no answer within {timeout_s:g} s", False)


@dataclass
class Episode:
    tokens: list[int] = field(default_factory=list)  # after the prompt
    mask: list[bool] = field(default_factory=list)  # True on the model's own tokens
    logprobs: list[float] = field(default_factory=list)  # of each token when generated (0 for tool tokens)
    no_eos: bool = True  # ended without an end token (length, budget or turns)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    final: list[int] = field(default_factory=list)  # the model's tokens after the last tool result
    versions: list[int] = field(default_factory=list)  # policy versions of its generation turns
    prompt: list[int] | None = None  # the episode's own prompt, when not the dataset's (an agent's rendering)
    # pictures tools returned, as the model reads them ((pixel_values, image_grid_thw) each), in order
    images: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # an environment's score of the episode (None: the dataflow's reward scores it) and its own numbers
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def generated(self, ids: list[int], logprobs: list[float], out, j: int) -> None:
        """Add turn `j` of a batched generate result `out`: the model's tokens (trained) and its versions."""
        self.tokens += ids
        self.mask += [True] * len(ids)
        self.logprobs += logprobs
        self.turns += 1
        self.final = ids
        if out.versions is not None and out.versions[j] is not None:
            self.versions += [out.versions[j], (out.last_versions or out.versions)[j]]

    def inserted(self, ids: list[int]) -> None:
        """Add tokens a tool or an environment wrote (never trained; log-prob 0)."""
        self.tokens += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.final = []


def generate_turn(
    engine,
    tokenizer,
    episodes: list[Episode],
    active: list[int],
    prompts: list[list[int]],
    g: GenerationHyperparameters,
    budget: int,
    extra: dict[str, list[torch.Tensor]] | None = None,
) -> tuple[list[list[int]], Any]:
    """One turn of the `active` episodes: a batched generate call on each one's prompt and tokens so far
    (`extra`: more keys of the batch, e.g. images), at most `budget` tokens per episode in all, recorded
    in the episodes (`Episode.generated`). Each one's new tokens, and the generate result."""
    room = max(budget - len(episodes[i].tokens) for i in active)
    step = g.model_copy(update={"max_new_tokens": min(g.max_new_tokens, room)})
    seqs = [torch.tensor(prompts[i] + episodes[i].tokens) for i in active]
    batch = SequenceSample.from_lists(list(range(len(active))), {"packed_prompts": seqs, **(extra or {})})
    out = engine.generate(batch, MicroBatchSpec(), tokenizer, step)
    new = []
    for j, i in enumerate(active):
        left = budget - len(episodes[i].tokens)
        ids = list(out.output_ids[j][:left])
        episodes[i].generated(ids, list(out.logprobs[j][:left]), out, j)
        new.append(ids)
    return new, out


class ToolUseWorkflow:
    """Generate; on a tool call run the tool and append its result; continue up to max_turns."""

    Args = ToolUseArgs

    def __init__(self, args: ToolUseArgs):
        self.args = args
        self.tools = {name: get_tool(name) for name in args.tools}

    def _result_ids(self, tokenizer, result: str | ToolOutput, room: int) -> tuple[list[int], Any]:
        """The tokens of a tool's result in `result_template`, at most `room` of them, and the pictures it
        returned as the model reads them (None: none). Pictures for a model that reads none, or that do not
        fit whole, become a note in the text."""
        text = self.args.result_template.format(result=str(result))
        pictures = result.images if isinstance(result, ToolOutput) else []
        encoder = vision.encoder_of(tokenizer)
        if pictures and encoder is not None:
            try:
                pixels, grids = encoder.encode([vision.open_image(x, Path.cwd()) for x in pictures])
                ids = encoder.tokenize(tokenizer, text, grids)
                if len(ids) <= room:
                    return ids, (pixels, grids)
                text = self.args.result_template.format(result=f"{result} (its pictures do not fit)")
            except DataError as e:
                text = self.args.result_template.format(result=f"{result} (error: its picture: {e})")
        elif pictures:
            text = self.args.result_template.format(result=f"{result} (a picture the model cannot see)")
        text = text.replace(vision.IMAGE_MARK, "")
        return tokenizer(text, add_special_tokens=False)["input_ids"][:room], None

    def _call(self, text: str) -> tuple[str | ToolOutput, bool]:
        """The tool's result text for a call, and ok. A call is the argument text (`name: arg` with
        several tools), or JSON as instruct models' chat templates write it: `{"name": "calculator",
        "arguments": {"expression": "2*3"}}` (an argument object with one value passes that value)."""
        name, arg = next(iter(self.tools)), text
        if text.strip().startswith("{"):
            try:
                call = json.loads(text)
                name, arg = call["name"], call.get("arguments", "")
            except (ValueError, KeyError, TypeError):
                return 'error: a JSON tool call is {"name": ..., "arguments": ...}', False
        elif len(self.tools) > 1:
            name, _, arg = text.partition(":")
            name = name.strip()
        return run_tool(self.tools, name, arg, self.args.tool_timeout_s)

    def run(
        self,
        engine,
        tokenizer,
        prompts: list[list[int]],
        gconfig: GenerationHyperparameters,
        images: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[Episode]:
        """`images`: each prompt's (pixel_values, image_grid_thw), a vision-language model's; every turn
        generates with them and with the pictures tools returned so far."""
        a = self.args
        close = tokenizer(a.call_close, add_special_tokens=False)["input_ids"]
        eos = {tokenizer.eos_token_id, *gconfig.stop_token_ids}
        if len(close) == 1:  # a single token: stop on its id
            g = gconfig.model_copy(
                update={"stop_token_ids": sorted(set(gconfig.stop_token_ids) | set(close))}
            )
        else:  # several: stop on the text
            g = gconfig.model_copy(update={"stop": list(dict.fromkeys([*gconfig.stop, a.call_close]))})
        g = g.model_copy(update={"min_new_tokens": 0})  # a turn may be a call straight away
        closes = StopTexts([a.call_close], lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        episodes = [Episode() for _ in prompts]
        active = list(range(len(prompts)))
        for turn in range(a.max_turns):
            active = [i for i in active if len(episodes[i].tokens) < a.max_total_tokens]
            if not active:
                break
            extra = {}
            if images is not None:  # the prompt's pictures and the tools' so far
                seen = [vision.stacked([images[i], *episodes[i].images]) for i in active]
                extra = {"pixel_values": [x[0] for x in seen], "image_grid_thw": [x[1] for x in seen]}
            new, out = generate_turn(
                engine, tokenizer, episodes, active, prompts, g, a.max_total_tokens, extra
            )
            still = []
            for j, (i, ids) in enumerate(zip(active, new, strict=True)):
                ep = episodes[i]
                ended = bool(ids) and not out.no_eos[j] and ids[-1] not in eos
                called = ended and closes.matched(ids) is not None and turn < a.max_turns - 1
                if not called:
                    ep.no_eos = not (ids and ids[-1] in eos)
                    continue
                text = tokenizer.decode(ids, skip_special_tokens=True)
                end = text.rfind(a.call_close)
                start = text.rfind(a.call_open, 0, end)
                call = text[start + len(a.call_open) : end] if start >= 0 else ""
                result, ok = self._call(call) if start >= 0 else ("error: no call was opened", False)
                ep.tool_calls += 1
                ep.tool_errors += not ok
                result_ids, seen = self._result_ids(tokenizer, result, a.max_total_tokens - len(ep.tokens))
                if seen is not None:
                    ep.images.append(seen)
                ep.inserted(result_ids)
                still.append(i)
            active = still
        return episodes
