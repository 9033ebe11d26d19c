"""A verifiers harness that runs the `null` harness's chat program inside the training process.

verifiers (>= 0.4) runs an agent as a program talking to its rollout's interception server; its `null`
harness is a plain chat loop (system prompt, the task's prompt, the model's replies, MCP tool calls
answered as `tool` messages) launched as a `uv` script per rollout. `arealcli_chat` runs that same
program text in this process's event loop: no interpreter to start, no package download, every model
call still through the interception endpoint (verifiers' contract for a harness). Selected with
`harness: {id: arealcli_chat}`; the verifiers workflow of arealcli makes it every role's default.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import traceback
from typing import Any

from verifiers.v1.clients import ModelContext
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

_PROGRAM = compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec")


class InProcessChatConfig(NullHarnessConfig):
    id: str = "arealcli_chat"


class InProcessChatHarness(NullHarness):
    """The null harness's chat program, run in-process (see the module doc)."""

    async def setup(self, runtime: Runtime) -> None:  # nothing to install
        return None

    async def launch(
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        mcp_config = {
            "mcpServers": {
                name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()
            }
        }
        args = argparse.Namespace(
            base_url=endpoint,
            api_key=secret,
            model=ctx.model,
            system_prompt=system_prompt or "",
            prompt=prompt if isinstance(prompt, str) else "",
            initial_messages_file="",
            mcp_config=json.dumps(mcp_config) if mcp_urls else "",
            tool_interception_url=tool_interception_url or "",
            bash=False,
            compaction=False,
            summarize_at_tokens=None,
            edit=False,
            search=False,
            serper_key="",
        )
        program: dict[str, Any] = {"__name__": "verifiers_chat_program"}
        exec(_PROGRAM, program)  # the program's functions, in a namespace of this rollout's own
        program["parse_args"] = lambda: args
        # the program's HTTP clients, closed when it ends (a process of its own would just exit)
        made: list[Any] = []
        build = program["DefaultAsyncHttpxClient"]

        def http_client(*a: Any, **k: Any) -> Any:
            made.append(build(*a, **k))
            return made[-1]

        program["DefaultAsyncHttpxClient"] = http_client
        if prompt is not None and not isinstance(prompt, str):  # a conversation: the program reads a file
            with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:  # (and removes it)
                f.write(json.dumps([message_to_wire(m) for m in prompt]).encode())
            args.initial_messages_file = f.name
        try:
            try:
                await program["main"]()
            finally:
                for client in made:
                    await client.aclose()
        except SystemExit as e:  # the program's exit on a model transport error
            code = e.code if isinstance(e.code, int) else MODEL_TRANSPORT_ERROR_EXIT_CODE
            return ProgramResult(code, "", traceback.format_exc())
        except Exception:
            return ProgramResult(1, "", traceback.format_exc())
        return ProgramResult(0, "", "")


__all__ = ["InProcessChatHarness"]
