"""Argument models of the built-in episode workflows."""

from __future__ import annotations

from pydantic import Field, PositiveInt, field_validator, model_validator

from arealcli.schema.base import StrictModel


class ToolUseArgs(StrictModel):
    """Multi-turn tool use: the model's tool calls are run and their results appended, up to max_turns.

    The model's own tokens train, tool output never does; the reward scores the final answer."""

    tools: list[str] = Field(
        default_factory=lambda: ["calculator"], description="Registered tools it may call."
    )
    call_open: str = Field("[", description="Text that opens a tool call: `[12*34]` calls the (first) tool.")
    call_close: str = Field(
        "]", description="Text that closes a tool call (generation stops on it; any number of tokens)."
    )
    result_template: str = Field(
        "={result} ", description="How a tool's result is written back, {result} filled in."
    )
    max_turns: PositiveInt = Field(3, le=64, description="Generation turns per episode (tool calls + 1).")
    max_total_tokens: PositiveInt = Field(
        64, le=1 << 20, description="Token budget of an episode after its prompt (model and tool tokens)."
    )
    allow_python: bool = Field(False, description="Enable the python tool (code execution in a sandbox).")

    @field_validator("tools")
    @classmethod
    def _registered(cls, tools: list[str]) -> list[str]:
        from arealcli.schema.registry import TOOLS, RegistryError

        for name in tools:
            try:
                TOOLS.get(name)
            except RegistryError as e:
                raise ValueError(str(e)) from None
        return tools

    @model_validator(mode="after")
    def _python_on_purpose(self) -> ToolUseArgs:
        if "python" in self.tools and not self.allow_python:
            raise ValueError(
                "the python tool runs code the model writes: enable it explicitly with allow_python: true"
            )
        return self


class AgentArgs(StrictModel):
    """An agent written against the OpenAI client interface (`arealcli.runtime.agent.AgentWorkflow`)."""

    max_total_tokens: PositiveInt = Field(
        64, le=1 << 20, description="Token budget of an episode after its prompt (model and inserted tokens)."
    )
    max_requests: PositiveInt = Field(8, le=1024, description="Requests to the model per episode.")
