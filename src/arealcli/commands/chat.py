"""`areal chat TARGET`: talk to a model folder, a run's checkpoint or an OpenAI-compatible server."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from arealcli.commands.common import Device, Dtype, console, err_console, fail, flag, say_error
from arealcli.errors import UserError

Target = Annotated[
    str,
    typer.Argument(
        metavar="TARGET",
        help="A model folder, a run directory (its latest checkpoint), one checkpoint, or an http(s) URL.",
    ),
]
Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        metavar="NAME",
        help="Run directory: which model (default: the one the recipe generates with). URL: the served "
        "model's name (default: the first listed).",
    ),
]
Step = Annotated[
    int | None,
    typer.Option(
        "--step", min=0, metavar="N", help="Run directory: the checkpoint of step N (default: the latest)."
    ),
]
Temperature = Annotated[float, typer.Option(min=0, metavar="T", help="Sampling temperature; 0 = greedy.")]
TopP = Annotated[
    float,
    typer.Option(
        "--top-p", min=0.01, max=1, metavar="P", help="Sample from the most likely tokens making up P."
    ),
]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=1, metavar="N", help="Longest reply.")]
System = Annotated[
    str | None, typer.Option("--system", metavar="TEXT", help="A system message opening the chat.")
]
Completion = Annotated[bool, flag("--completion", "Plain completion even if the model has a chat template.")]
DeviceOpt = Annotated[Device, typer.Option(help="Local models: auto = cuda when available, else cpu.")]
DtypeOpt = Annotated[Dtype, typer.Option(help="Local models: weights and compute dtype.")]
Seed = Annotated[
    int | None,
    typer.Option("--seed", metavar="N", help="Local models: seed the sampling (same seed, same replies)."),
]
SendKey = Annotated[
    bool,
    flag(
        "--send-key",
        "URL: send AREAL_API_KEY to it although it is not on this machine (loopback URLs get it without "
        "this flag).",
    ),
]


Images = Annotated[
    list[Path] | None,
    typer.Option(
        "--image",
        metavar="PATH",
        help="A picture for the first message (repeat for several; a vision-language model). In the chat, "
        "/image PATH attaches one to the next message.",
    ),
]


def chat(
    target: Target,
    model: Model = None,
    step: Step = None,
    temperature: Temperature = 0.7,
    top_p: TopP = 1.0,
    max_new_tokens: MaxNewTokens = 256,
    system: System = None,
    completion: Completion = False,
    device: DeviceOpt = Device.auto,
    dtype: DtypeOpt = Dtype.float32,
    seed: Seed = None,
    send_key: SendKey = False,
    image: Images = None,
) -> None:
    """Chat in the terminal with a model; plain completion for models without a chat template.

    Examples:
    areal chat runs/quickstart --temperature 0
    areal chat runs/quickstart --step 200 --model actor
    areal chat ~/models/Qwen2.5-0.5B-Instruct --system "Answer briefly."
    areal chat http://127.0.0.1:30000 --max-new-tokens 64
    areal chat runs/vlm-quickstart --image data/colours/images/test-0000.png --temperature 0
    AREAL_API_KEY=... areal chat https://gpu7.example.org:30000 --send-key

    A line ending in \\ continues the message; /reset, /history, /exit (or Ctrl-D).
    With stdin piped, each message's reply is printed as plain text.
    """
    from arealcli.runtime.console.chat import ChatError, ChatScreen, Conversation, SamplingFlags

    flags = SamplingFlags(temperature, top_p, max_new_tokens)
    try:
        engine = _engine(target, model, step, device.value, dtype.value, seed, send_key)
    except UserError as e:
        raise fail(e.lines) from None
    interactive = sys.stdin.isatty()
    conversation = Conversation(engine, flags, system, completion)
    for path in image or []:
        try:
            conversation.attach(str(path))
        except ChatError as e:
            engine.close()
            raise fail([f"--image {e}"]) from None
    screen = ChatScreen(conversation, console, err_console, interactive)
    try:
        screen.run()
    except UserError as e:  # the server went away
        raise fail(e.lines) from None
    finally:
        engine.close()


def _engine(target: str, model, step, device: str, dtype: str, seed, send_key: bool):
    """What answers: a server at a URL (a note when the key is withheld from it), or a model loaded
    here from a folder, a run directory or a checkpoint. UserError when the target is not one."""
    from arealcli.runtime.run.targets import find_model, is_url

    if is_url(target):
        if step is not None:
            raise UserError("--step chooses a checkpoint of a run directory, not of a URL")
        from arealcli.runtime.serve.chat import RemoteChat, key_withheld, withheld_note

        if key_withheld(target, send_key):
            say_error(withheld_note(target), title="note")
        return RemoteChat(target, model, send_key=send_key)
    found = find_model(Path(target).expanduser(), model, step)
    from arealcli.runtime.serve.chat import LocalChat

    if seed is not None:
        import torch

        torch.manual_seed(seed)
    return LocalChat(str(found.model_dir), found.describe(), device, dtype)
