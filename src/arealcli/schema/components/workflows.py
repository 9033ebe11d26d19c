"""Argument models of the built-in episode workflows."""

from __future__ import annotations

import string

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
    """Function calling in the model's own chat template (calls in its format: Hermes, Llama 3 JSON,
    Mistral, Qwen3-Coder).

    The question goes in a user message, the tools are offered as OpenAI function schemas, each
    call the model writes is run and answered with a `tool` message, until a
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


class OpenEnvArgs(StrictModel):
    """An OpenEnv environment (served over HTTP/WebSocket by openenv's server): reset, then the model acts
    and the environment steps, up to max_turns; the episode's reward is the sum of the step rewards.

    Each episode holds one WebSocket session (`/ws`): `reset` with `reset_args` (text values formatted with
    the dataset's `{prompt}`), the observation written to the model with `observation_template` (its
    fields; the first one is the episode's prompt), the model's text sent as the action (`action_field`:
    {field: text}; unset: the text is the action's JSON), the next observation appended (never trained),
    until the environment says done. Rewards need `reward: {environment: true}` in the dataflow."""

    url: str | None = Field(None, description="A running environment server (http://host:port).")
    app: str | None = Field(
        None,
        description="Start the environment server with the run: `module:app` (an ASGI app, e.g. openenv's "
        "`create_app(...)`), served by uvicorn on a free local port; modules are found in the current "
        "directory and beside the recipe.",
    )
    app_dir: str | None = Field(
        None,
        description="A folder to find app's module in, before the current directory and the recipe's (the "
        "run's recipe.yaml records the recipe's folder here, so `areal eval RUN` and resume find it).",
    )
    reset_args: dict[str, object] = Field(
        default_factory=dict,
        description="Keyword arguments of `reset`; text values are formatted with {prompt}: the dataset's prompt.",
    )
    action_field: str | None = Field(
        None,
        min_length=1,
        description="The action field the model's text goes in ({field: text}); unset: the model writes the "
        "action as JSON.",
    )
    observation_template: str = Field(
        "{observation}",
        min_length=1,
        description="How an observation is shown to the model: format fields are its fields ({observation}: "
        "all of them as JSON).",
    )
    max_turns: PositiveInt = Field(1, le=64, description="Actions per episode.")
    max_total_tokens: PositiveInt = Field(
        64,
        le=1 << 20,
        description="Token budget of an episode after its prompt (model and observation tokens).",
    )
    sessions: PositiveInt = Field(
        64,
        le=4096,
        description="WebSocket sessions at once (the server's max_concurrent_envs); more episodes run in waves.",
    )
    timeout_s: float = Field(60.0, gt=0, description="Longest wait for one reply of the environment.")
    start_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for a started server to answer /health."
    )

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvArgs:
        if (self.url is None) == (self.app is None):
            raise ValueError(
                "give the environment's server: url (running) or app (module:app, started by the run)"
            )
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http(s)://host:port, got {self.url!r}")
        if self.app is not None and ":" not in self.app:
            raise ValueError(f"app is module:attribute (e.g. my_env.server.app:app), got {self.app!r}")
        for key, value in self.reset_args.items():
            if not isinstance(value, str):
                continue
            try:
                fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
            except ValueError as e:
                raise ValueError(f"reset_args.{key}: {e} (a literal brace is written {{{{ or }}}})") from None
            if fields - {"prompt"}:
                raise ValueError(
                    f"reset_args.{key} names {sorted(fields - {'prompt'})}: only {{prompt}} (the dataset's prompt) is filled in"
                )
        return self


class VerifiersArgs(AgentArgs):
    """A verifiers environment (verifiers >= 0.4: Taskset, Env, rewards) run on each task of the batch.

    The environment runs unchanged: its rollout logic, its rubric (`@vf.reward` methods), its tools. Its
    model calls go to an OpenAI-compatible chat endpoint this run serves on 127.0.0.1 (one path per
    episode), answered by the policy in batched generate calls; the token ids and log-probs that train are
    the ones generated there. Every role of the env runs the `arealcli_chat` harness (verifiers' `null`
    chat program, in this process) unless the recipe names another. The episode's reward is the trace's
    (the weighted sum of its rewards); each reward and metric is logged as `env/NAME`. The dataset is the
    `verifiers` dataset of the same taskset. Rewards need `reward: {environment: true}` in the dataflow."""

    env: dict[str, object] = Field(
        description="The env's config as verifiers takes it (`vf.resolve_env_config`): {taskset: {id, ...}, "
        "id: ENV (optional), ROLE: {harness, max_turns, ...}, ...the env's own fields}.",
    )
    env_dir: str | None = Field(
        None,
        description="A folder to find the env's modules in, before the recipe's and the current directory "
        "(the run's recipe.yaml records the recipe's folder here).",
    )
    model_name: str = Field(
        "policy", min_length=1, description="The model name the environment's calls carry."
    )
    max_total_tokens: PositiveInt = Field(
        256,
        le=1 << 20,
        description="Token budget of an episode after its prompt (model and inserted tokens).",
    )

    @model_validator(mode="after")
    def _taskset_named(self) -> VerifiersArgs:
        taskset = self.env.get("taskset")
        if not isinstance(taskset, dict) or not isinstance(taskset.get("id"), str):
            raise ValueError("env needs its taskset: {taskset: {id: MODULE, ...}}")
        return self
