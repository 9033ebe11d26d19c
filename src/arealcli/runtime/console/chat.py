"""`areal chat`'s conversation in a terminal: read a message, ask the engine, show the reply.

A message is one line; a line ending in `\\` continues on the next, and a line holding only `\"\"\"`
starts a block (for pastes) that the next such line ends. `/image PATH` attaches a picture to the next
message (a vision-language model; `--image` to the first). `/reset` clears the conversation, `/history`
shows it again, `/exit` (or Ctrl-D) quits; Ctrl-C stops a reply being generated (it is not kept) or
clears the line being typed. A model with a chat template gets the whole conversation rendered by it
(the `--system` message first); one without is a completion model: each message is completed on its own.

In a terminal: a banner, prompts, replies labelled and coloured. Piped (stdin not a terminal): no
banner and no prompts, each reply printed as plain text on its own line(s), so a script can read them.
The engine behind (`ChatEngine`) is in this process or at a URL; this module imports no engine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rich.console import Console
from rich.rule import Rule
from rich.text import Text

BLOCK = '"""'
PROMPT, MORE = "you> ", "...> "
USER_STYLE, MODEL_STYLE, SYSTEM_STYLE = "bold green", "bold cyan", "bold magenta"
HELP = [
    'Enter sends; a line ending in \\ continues; a line of """ starts or ends a block.',
    "/image PATH attaches a picture to the next message,",
    "/reset clears the chat, /history shows it, /exit or Ctrl-D quits,",
    "Ctrl-C stops a reply.",
]
COMMANDS = ("/reset", "/history", "/help", "/exit", "/quit")


@dataclass(frozen=True)
class SamplingFlags:
    temperature: float  # 0 = greedy
    top_p: float
    max_new_tokens: int

    def describe(self) -> str:
        how = "greedy" if self.temperature <= 0 else f"temperature {self.temperature:g}, top-p {self.top_p:g}"
        return f"{how}; at most {self.max_new_tokens} new tokens"


@dataclass(frozen=True)
class Reply:
    text: str
    finish: str  # stop (an end token or stop text), length (max_new_tokens or the context), abort (Ctrl-C)
    tokens: int  # generated


class ChatError(Exception):
    """A message the engine cannot answer (too long for the context, refused by a server): said, and the
    conversation goes on without it."""


class ChatEngine(Protocol):
    name: str  # what is being talked to, for the banner
    chat_template: bool  # messages are rendered with a chat template (else: plain completion)

    def chat(self, messages: list[dict[str, Any]], sampling: SamplingFlags) -> Reply:
        """Messages in OpenAI's form: `content` a text, or parts (text and image_url with a data: URL)."""
        ...

    def complete(self, prompt: str, sampling: SamplingFlags, images: list[str] | None = None) -> Reply: ...

    def close(self) -> None: ...


class Conversation:
    """The messages so far (chat mode) and how the next one is answered."""

    def __init__(self, engine: ChatEngine, sampling: SamplingFlags, system: str | None, completion: bool):
        self.engine, self.sampling, self.system = engine, sampling, system
        self.completion = completion or not engine.chat_template
        self.messages: list[dict[str, Any]] = []
        self.images: list[str] = []  # data: URLs of pictures for the next message (`attach`)

    def reset(self) -> None:
        self.messages = []

    def attach(self, path: str) -> None:
        """A picture for the next message; ChatError when it is not a readable image."""
        from arealcli.errors import DataError
        from arealcli.runtime.vision import image_data_url

        try:
            self.images.append(image_data_url(path))
        except (DataError, OSError) as e:
            raise ChatError(f"{path}: {e}") from None

    def send(self, text: str) -> Reply:
        """The reply to `text` (with the pictures attached since the last message); kept in the
        conversation unless it was stopped (ChatError: nothing kept)."""
        images, self.images = self.images, []
        try:
            if self.completion:
                return self.engine.complete(text, self.sampling, images or None)
            system = [{"role": "system", "content": self.system}] if self.system else []
            content: Any = text
            if images:
                content = [{"type": "image_url", "image_url": {"url": u}} for u in images]
                content.append({"type": "text", "text": text})
            turn = {"role": "user", "content": content}
            reply = self.engine.chat([*system, *self.messages, turn], self.sampling)
        except ChatError:
            self.images = images  # still attached for the next try
            raise
        if reply.finish != "abort":
            self.messages += [turn, {"role": "assistant", "content": reply.text}]
        return reply


def shown(content: Any) -> str:
    """A message's content as text: parts joined, each picture as [image]."""
    if isinstance(content, str):
        return content
    return "".join("[image] " if p.get("type") == "image_url" else p.get("text", "") for p in content)


def read_message(read: Callable[[str], str]) -> str | None:
    """The next message (see the module doc); None at the end of the input. `read(prompt)` returns a
    line without its newline and raises EOFError at the end."""
    try:
        line = read(PROMPT)
    except EOFError:
        return None
    lines: list[str] = []
    try:
        if line.strip() == BLOCK:
            while (line := read(MORE)).strip() != BLOCK:
                lines.append(line)
            return "\n".join(lines)
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = read(MORE)
    except EOFError:  # the input ended inside a message: send what there is
        return "\n".join(lines)
    return "\n".join([*lines, line])


def _bold_green(text: str) -> str:
    """A prompt for input(): escape codes wrapped in \\001 \\002 so readline counts only the text."""
    return f"\001\033[1;32m\002{text}\001\033[0m\002"


class ChatScreen:
    """The loop: banner, messages, replies (see the module doc)."""

    def __init__(self, conversation: Conversation, console: Console, err: Console, interactive: bool):
        self.conv, self.console, self.err, self.interactive = conversation, console, err, interactive

    def run(self) -> None:
        if self.interactive:
            try:
                import readline  # noqa: F401  (line editing and history in input())
            except ImportError:  # not on every platform
                pass
            self.banner()
        while True:
            try:
                text = read_message(self._read)
            except KeyboardInterrupt:
                self.console.print(Text("(/exit or Ctrl-D quits)", style="dim"))
                continue
            if text is None:
                if self.interactive:
                    self.console.print()
                return
            if not text.strip():
                continue
            if text.strip().lower().startswith("/image"):
                self.attach(text.strip()[len("/image") :].strip())
                continue
            if text.strip().lower() in COMMANDS:
                if not self.command(text.strip().lower()):
                    return
                continue
            self.answer(text)

    def attach(self, path: str) -> None:
        if not path:
            self.err.print(Text("/image PATH: give the picture's file", style="yellow"))
            return
        try:
            self.conv.attach(path)
        except ChatError as e:
            self.err.print(Text(str(e), style="yellow"))
            return
        if self.interactive:
            n = len(self.conv.images)
            self.console.print(Text(f"{n} picture(s) attached to the next message", style="dim"))

    def _read(self, prompt: str) -> str:
        if self.interactive:
            return input(_bold_green(prompt) if self.console.is_terminal else prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n").rstrip("\r")

    def banner(self) -> None:
        from arealcli.runtime.console.progress import header

        conv = self.conv
        if not conv.completion:
            mode = "chat: the conversation is rendered with the model's chat template"
        else:
            why = "as asked" if conv.engine.chat_template else "the model has no chat template"
            mode = f"completion ({why}): each message is completed on its own, without history"
            if conv.system:
                mode += "; --system is not used"
        lines = [("chat", conv.engine.name), ("mode", mode), ("sampling", conv.sampling.describe())]
        if conv.system and not conv.completion:
            lines.append(("system", conv.system))
        header(self.console, [*lines, ("keys", " ".join(HELP))])

    def command(self, name: str) -> bool:
        """Run a /command; False to quit."""
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.conv.reset()
            if self.interactive:
                self.console.print(Rule("conversation cleared", style="dim"))
        elif name == "/history":
            self.history()
        else:
            for line in HELP:
                self.console.print(Text(line, style="dim"))
        return True

    def history(self) -> None:
        conv = self.conv
        if conv.completion:
            self.console.print(Text("completion mode keeps no history", style="dim"))
            return
        self.console.print(Rule(f"conversation: {len(conv.messages) // 2} exchange(s)", style="dim"))
        if conv.system:
            self.console.print(Text.assemble(("system> ", SYSTEM_STYLE), conv.system))
        for m in conv.messages:
            user = m["role"] == "user"
            label, style = (PROMPT, USER_STYLE) if user else ("model> ", MODEL_STYLE)
            self.console.print(Text.assemble((label, style), shown(m["content"])))
        self.console.print(Rule(style="dim"))

    def answer(self, text: str) -> None:
        try:
            if self.interactive:
                with self.console.status("generating (Ctrl-C stops)", spinner="dots"):
                    reply = self.conv.send(text)
            else:
                reply = self.conv.send(text)
        except ChatError as e:
            self.err.print(Text.assemble(("error: ", "bold red"), str(e)))
            return
        except KeyboardInterrupt:  # between the engine's own handling (rendering, a second Ctrl-C)
            self.console.print(Text("[stopped: not kept in the conversation]", style="dim"))
            return
        self.show(reply)

    def show(self, reply: Reply) -> None:
        if not self.interactive:
            self.console.print(Text(reply.text), soft_wrap=True)
            return
        line = Text.assemble(("model> ", MODEL_STYLE), reply.text.rstrip())
        if reply.finish == "length":
            line.append(f"  [cut at {reply.tokens} tokens]", style="dim")
        elif reply.finish == "abort":
            line.append("  [stopped: not kept in the conversation]", style="dim")
        self.console.print(line)
