"""The built-in `function_calling` workflow: function calling in the model's own chat template.

An episode is an OpenAI function-calling loop run through the in-process agent client (see agent.py):

    messages = [system prompt?, user: the dataset's question]
    repeat up to max_turns replies:
        reply <- the model, with the registered tools offered as functions (rendered by the template)
        no call in the reply: the episode is over (its final answer is the reply)
        else: run each call, append the reply and a `tool` message with each result

Calls are written in the template's format (Hermes `<tool_call>` of Qwen2.5 and Qwen3, Llama 3 JSON,
Mistral `[TOOL_CALLS]`, Qwen3-Coder XML: wire/tool_calls.py). The replies train; the template's text, the question and the tool
results do not.
"""

from __future__ import annotations

import json

from arealcli.runtime.agents.agent import AgentClient, AgentWorkflow
from arealcli.runtime.agents.workflows import run_tool
from arealcli.runtime.tools import get_tool, tool_schema
from arealcli.schema.components.workflows import FunctionCallingArgs


class FunctionCallingWorkflow(AgentWorkflow):
    """Function calling through the model's chat template (see the module docstring)."""

    Args = FunctionCallingArgs
    args: FunctionCallingArgs

    def __init__(self, args: FunctionCallingArgs):
        super().__init__(args)
        self.tools = {name: get_tool(name) for name in args.tools}
        self.schemas = [tool_schema(name) for name in args.tools]

    def episode(self, client: AgentClient, prompt: str) -> None:
        a = self.args
        messages: list = [{"role": "system", "content": a.system_prompt}] if a.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        for _ in range(a.max_turns - 1):
            completion = client.chat.completions.create(model="policy", messages=messages, tools=self.schemas)
            message = completion.choices[0].message
            assert message is not None  # a chat completion's choice always carries its message
            if not message.tool_calls:
                return
            messages.append(message)
            for call in message.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = call.function.arguments
                result, ok = run_tool(self.tools, call.function.name, arguments, a.tool_timeout_s)
                client.record_tool(ok)
                messages.append(
                    # (its text: pictures reach the model in tool_use episodes)
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "name": call.function.name,
                        "content": str(result),
                    }
                )
        client.chat.completions.create(
            model="policy", messages=messages, tools=self.schemas
        )  # the last reply
