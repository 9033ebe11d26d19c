"""`areal chat TARGET`: talk to a model folder, a run's checkpoint or an OpenAI-compatible server."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from arealcli.commands.common import console, err_console, fail, say_error
from arealcli.commands.serve import Device, Dtype
from arealcli.errors import UserError


def chat(
    target: str = typer.Argument(
        ...,
        metavar="TARGET",
        help="A model folder, a run directory (its latest checkpoint), one checkpoint, or an http(s) URL.",
    ),
    model: str = typer.Option(
        None,
        "--model",
        metavar="NAME",
        help="Run directory: which model (default: the one the recipe generates with). URL: the served "
        "model's name (default: the first listed).",
    ),
    step: int = typer.Option(
        None,
        "--step",
        min=0,
        metavar="N",
        help="Run directory: the checkpoint of step N (default: the latest).",
    ),
    temperature: float = typer.Option(0.7, min=0, metavar="T", help="Sampling temperature; 0 = greedy."),
    top_p: float = typer.Option(
        1.0, "--top-p", min=0.01, max=1, metavar="P", help="Sample from the most likely tokens making up P."
    ),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=1, metavar="N", help="Longest reply."),
    system: str = typer.Option(None, "--system", metavar="TEXT", help="A system message opening the chat."),
    completion: bool = typer.Option(
        False, "--completion", metavar="", help="Plain completion even if the model has a chat template."
    ),
    device: Device = typer.Option(Device.auto, help="Local models: auto = cuda when available, else cpu."),
    dtype: Dtype = typer.Option(Dtype.float32, help="Local models: weights and compute dtype."),
    seed: int = typer.Option(
        None, "--seed", metavar="N", help="Local models: seed the sampling (same seed, same replies)."
    ),
    send_key: bool = typer.Option(
        False,
        "--send-key",
        metavar="",
        help="URL: send AREAL_API_KEY to it although it is not on this machine (loopback URLs get it "
        "without this flag).",
    ),
) -> None:
    """Chat in the terminal with a model; plain completion for models without a chat template.

    Examples:
    areal chat runs/quickstart --temperature 0
    areal chat runs/quickstart --step 200 --model actor
    areal chat ~/models/Qwen2.5-0.5B-Instruct --system "Answer briefly."
    areal chat http://127.0.0.1:30000 --max-new-tokens 64
    AREAL_API_KEY=... areal chat https://gpu7.example.org:30000 --send-key

    A line ending in \\ continues the message; /reset, /history, /exit (or Ctrl-D).
    With stdin piped, each message's reply is printed as plain text.
    """
    from arealcli.runtime.console.chat import ChatScreen, Conversation, SamplingFlags
    from arealcli.runtime.run.targets import find_model, is_url

    flags = SamplingFlags(temperature, top_p, max_new_tokens)
    try:
        if is_url(target):
            if step is not None:
                raise UserError("--step chooses a checkpoint of a run directory, not of a URL")
            from arealcli.runtime.serve.chat import RemoteChat, key_withheld, withheld_note

            if key_withheld(target, send_key):
                say_error(withheld_note(target), title="note")
            engine = RemoteChat(target, model, send_key=send_key)
        else:
            found = find_model(Path(target).expanduser(), model, step)
            from arealcli.runtime.serve.chat import LocalChat

            if seed is not None:
                import torch

                torch.manual_seed(seed)
            engine = LocalChat(str(found.model_dir), found.describe(), device.value, dtype.value)
    except UserError as e:
        raise fail(e.lines) from None
    interactive = sys.stdin.isatty()
    screen = ChatScreen(Conversation(engine, flags, system, completion), console, err_console, interactive)
    try:
        screen.run()
    except UserError as e:  # the server went away
        raise fail(e.lines) from None
    finally:
        engine.close()
