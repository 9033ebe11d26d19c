"""Argument models of the built-in episode workflows."""

from __future__ import annotations

from pydantic import Field, PositiveInt, field_validator, model_validator

from arealcli.schema.base import StrictModel
from arealcli.schema.registry import TOOLS


class ToolSet(StrictModel):
    """The registered tools an episode may call; the python executor only when enabled on purpose."""

    tools: list[str] = Field(
        default_factory=lambda: ["calculator"], description="Registered tools it may call."
    )
    allow_python: bool = Field(False, description="Enable the python tool (code execution in a sandbox).")
    tool_timeout_s: float = Field(
        60.0, gt=0, description="A tool call with no answer after this long returns an error to the model."
    )

    @field_validator("tools")
    @classmethod
    def _registered(cls, tools: list[str]) -> list[str]:
        for name in tools:
            TOOLS.validated(name)
        return tools

    @model_validator(mode="after")
    def _python_on_purpose(self) -> ToolSet:
        if "python" in self.tools and not self.allow_python:
            raise ValueError(
                "the python tool runs code the model writes: enable it explicitly with allow_python: true"
            )
        return self


class ToolUseArgs(ToolSet):
    """Multi-turn tool use: the model's tool calls are run and their results appended, up to max_turns.

    The model's own tokens train, tool output never does; the reward scores the final answer."""

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


class AgentArgs(StrictModel):
    """An agent written against the OpenAI client interface (`arealcli.runtime.agents.agent.AgentWorkflow`)."""

    max_total_tokens: PositiveInt = Field(
        64, le=1 << 20, description="Token budget of an episode after its prompt (model and inserted tokens)."
    )
    max_requests: PositiveInt = Field(8, le=1024, description="Requests to the model per episode.")
    episode_timeout_s: float = Field(
        600.0,
        gt=0,
        description="An episode that neither asks the model nor finishes for this long (a hung tool or "
        "agent) stops the run with an error.",
    )


class FunctionCallingArgs(AgentArgs, ToolSet):
    """Function calling in the model's own chat template (Hermes-style calls: Qwen2.5, Qwen3, Hermes).

    The question goes in a user message, the tools are offered as OpenAI function schemas, each
    `<tool_call>{...}</tool_call>` the model writes is run and answered with a `tool` message, until a
    reply without a call (or max_turns). The dataset's prompts are plain questions (not rendered with the
    chat template: the workflow renders the conversation)."""

    max_turns: PositiveInt = Field(4, le=64, description="Model replies per episode (tool rounds + 1).")
    system_prompt: str | None = Field(None, description="A system message before the question.")
    max_total_tokens: PositiveInt = Field(
        1024,
        le=1 << 20,
        description="Token budget of an episode after its prompt (model and inserted tokens).",
    )

    @model_validator(mode="after")
    def _requests_for_every_turn(self) -> FunctionCallingArgs:
        if self.max_requests < self.max_turns:
            raise ValueError(
                f"max_requests ({self.max_requests}) must allow max_turns ({self.max_turns}) replies"
            )
        return self
