"""An agent written against the OpenAI client interface: the agent quickstart's calculator loop.

`calculator_agent` is plain OpenAI-client code: it runs against `areal serve`'s `/v1` endpoints with the
`openai` package, and, registered as the `calculator_agent` workflow, it generates training episodes
in process. Use it from a recipe beside this file (or with this folder on PYTHONPATH):

    imports: [calculator_agent]
    dataflow: {actor: {workflow: {type_: calculator_agent, args: {max_total_tokens: 32}}}}
"""

from __future__ import annotations

from arealcli.runtime.agents.agent import AgentWorkflow
from arealcli.runtime.tools import ToolError, calculator
from arealcli.schema.registry import register_workflow


def calculator_agent(client, prompt: str, max_turns: int = 3, **sampling) -> str:
    """Ask; while the model writes a call `[...]`, append the calculator's result `={result} ` and ask
    again; returns the final answer."""
    text = prompt
    for turn in range(max_turns):
        choice = client.completions.create(
            model="policy", prompt=text, max_tokens=12, stop="]", **sampling
        ).choices[0]
        text += choice.text
        called = getattr(choice, "stop_reason", None) == "]" and "[" in choice.text
        if not called or turn == max_turns - 1:
            return choice.text
        try:
            result = calculator(choice.text[choice.text.rfind("[") + 1 :])
        except ToolError as e:
            result = f"error: {e}"
        text += f"]={result} "  # the stop text is not part of the returned text
    return ""


class CalculatorAgent(AgentWorkflow):
    """The calculator loop as a training workflow: episodes from `calculator_agent`."""

    def episode(self, client, prompt: str) -> None:
        calculator_agent(client, prompt)


register_workflow("calculator_agent", CalculatorAgent)
