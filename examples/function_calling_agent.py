"""OpenAI function calling, trained: an agent written for the `openai` package, used as a workflow.

`function_calling_agent` is ordinary function-calling code: it offers a calculator as a tool, runs every
call the model makes, sends the results back as `tool` messages, and stops at the first reply without a
call. Pointed at `areal serve` (`OpenAI(base_url="http://HOST:PORT/v1", api_key="unused")`) it talks to
the policy being trained; registered as the `function_calling_agent` workflow, the same code generates
the training episodes in process (the calls and the answer train, the tool turns do not). The served
chat template must write Hermes-style calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
as Qwen2.5 and Qwen3 do). In a recipe beside this file:

    imports: [function_calling_agent]
    dataflow: {actor: {workflow: {type_: function_calling_agent, args: {max_total_tokens: 512}}}}
"""

from __future__ import annotations

import json

from arealcli.runtime.agents.agent import AgentWorkflow
from arealcli.runtime.tools import ToolError, calculator
from arealcli.schema.registry import register_workflow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % **, parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 417*38"}},
                "required": ["expression"],
            },
        },
    }
]


def run_tool(call) -> str:
    """The result text of one tool call (an error is a result too: the model reads it)."""
    try:
        if call.function.name != "calculator":
            return f"error: no tool {call.function.name!r}"
        return calculator(str(json.loads(call.function.arguments)["expression"]))
    except (ValueError, KeyError, TypeError, ToolError) as e:
        return f"error: {e}"


def function_calling_agent(client, question: str, max_turns: int = 4, max_tokens: int = 256, **sampling):
    """Ask with the tools offered; answer every call; return (final answer or None, the replies)."""
    messages: list = [{"role": "user", "content": question}]
    replies = []
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=max_tokens, **sampling
        )
        replies.append(reply)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return message.content, replies
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return None, replies


class FunctionCallingAgent(AgentWorkflow):
    """`function_calling_agent` as a training workflow."""

    def episode(self, client, prompt: str) -> None:
        function_calling_agent(client, prompt)


register_workflow("function_calling_agent", FunctionCallingAgent)
