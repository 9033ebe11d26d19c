"""Argument models of the built-in datasets."""

from __future__ import annotations

from pydantic import Field, PositiveInt, model_validator

from arealcli.schema.base import StrictModel
from arealcli.schema.registry import TOOLS

# Meta key of the data protocol: the pair each sample of preference data belongs to (its chosen and
# rejected responses stand next to each other with the same value, and stay together; runtime/data).
PAIR = "pair"
# Meta key: the margin m of each preference sample's pair (a reward model's loss -log sigma(s_w - s_l - m)).
MARGIN = "margin"


class DataSourceArgs(StrictModel):
    """Where rows come from: a local file or folder, or a dataset name from the Hugging Face cache."""

    path: str = Field(
        description="JSONL / JSON / Parquet / Arrow / CSV file, a folder of them (or one saved with "
        "`save_to_disk`), relative to the recipe file or absolute; or a Hub dataset name (e.g. openai/gsm8k) "
        "found in the Hugging Face cache."
    )
    split: str = Field("train", description="Split to read (files and folders: the split their files form).")
    subset: str | None = Field(None, description="Configuration of a Hub dataset (e.g. `main` for gsm8k).")
    limit: PositiveInt | None = Field(None, description="Use only the first N rows.")
    max_length: PositiveInt = Field(
        1024, le=1 << 22, description="Longest sequence in tokens (see each dataset)."
    )
    system_prompt: str | None = Field(None, description="A system message put first (chat templates only).")


class PromptAnswerArgs(DataSourceArgs):
    """Rows with a prompt (text or chat messages) and an answer; extra fields are ignored."""

    prompt_key: str = Field("prompt", description="Field holding the prompt text.")
    answer_key: str = Field(
        "answer", description="Field holding the answer: text, a number, or a list of accepted answers."
    )
    messages_key: str | None = Field(
        None,
        description="Field holding the prompt as chat messages [{role, content}] (instead of prompt_key).",
    )
    apply_chat_template: bool = Field(
        False,
        description="Render prompts with the tokenizer's chat template, ending with its generation prompt "
        "(instruct models).",
    )
    append_eos: bool = Field(True, description="End each answer with the tokenizer's EOS token.")
    image_key: str = Field(
        "image",
        description="Field holding the prompt's image(s), for a vision-language model: a path (relative to "
        "the data file), a data: URL, bytes or an image record (parquet, Hugging Face Image features), or a "
        "list of those; each goes where the prompt has `<image>`, else before the text. Rows without it "
        "are text only.",
    )
    episode_key: str | None = Field(
        None,
        description="Field holding a worked episode for SFT, [{role: assistant|tool, content}] as the "
        "workflow writes it (e.g. a tool call, its result, the answer): the SFT sequence is the prompt + "
        "those turns, the loss on assistant turns only. Rows without it train on their answer.",
    )
    episode_tools: list[str] | None = Field(
        None,
        description="Render worked episodes as the function_calling workflow's conversations: the chat "
        "template with these registered tools offered, the prompt as a user message, then the episode's "
        "messages (assistant turns with OpenAI `tool_calls`, `tool` turns). Prompts stay plain questions.",
    )

    @model_validator(mode="after")
    def _tools_for_episodes(self) -> PromptAnswerArgs:
        if self.episode_tools is None:
            return self
        if self.episode_key is None:
            raise ValueError("episode_tools renders worked episodes: set episode_key too")
        if self.apply_chat_template or self.messages_key is not None:
            raise ValueError(
                "with episode_tools the prompts stay plain questions: drop apply_chat_template / messages_key"
            )
        for name in self.episode_tools:
            TOOLS.validated(name)
        return self


class ChatArgs(DataSourceArgs):
    """Conversations for multi-turn SFT: the loss is on the assistant's tokens only."""

    messages_key: str = Field("messages", description="Field holding the conversation [{role, content}].")


class PreferenceArgs(DataSourceArgs):
    """Preference pairs: a prompt with a chosen and a rejected response (text or chat messages)."""

    prompt_key: str = Field(
        "prompt",
        description="Field holding the prompt: a text, or chat messages [{role, content}] (rendered with "
        "the tokenizer's chat template).",
    )
    chosen_key: str = Field(
        "chosen",
        description="Field holding the preferred response: a text, or messages [{role: assistant, content}].",
    )
    rejected_key: str = Field(
        "rejected",
        description="Field holding the dispreferred response: a text, or messages [{role: assistant, content}].",
    )
    apply_chat_template: bool = Field(
        False,
        description="Render text rows with the chat template too: the prompt as a user message, each "
        "response as an assistant message (rows given as messages always are).",
    )
    append_eos: bool = Field(
        True,
        description="End each text response with the tokenizer's EOS token (a chat template ends the "
        "assistant's turn itself).",
    )
    margin_key: str | None = Field(
        None,
        description="Field holding each pair's margin m, a number: how much better the chosen response "
        "is (a reward model's loss -log sigma(s_w - s_l - m)); without it every margin is 0.",
    )


class VerifiersTasksArgs(StrictModel):
    """The tasks of a verifiers taskset (verifiers >= 0.4): each task one row, its prompt rendered with the
    chat template; train on them with the `verifiers` workflow, which runs the environment on each."""

    taskset: dict[str, object] = Field(
        description="The taskset's config as verifiers takes it: {id: MODULE, ...its fields}; the module is "
        "an installed package or one found beside the recipe.",
    )
    taskset_dir: str | None = Field(
        None,
        description="A folder to find the taskset's module in, before the recipe's and the current directory "
        "(the run's recipe.yaml records the recipe's folder here).",
    )
    skip: int = Field(0, ge=0, description="Leave out the first N tasks.")
    limit: PositiveInt | None = Field(None, description="Use only N tasks (after skip).")
    answer_key: str | None = Field(
        "answer",
        description="The task field with a reference answer: SFT (a warm-up) learns the prompt + it; tasks "
        "without the field train no SFT tokens.",
    )
    append_eos: bool = Field(True, description="End the SFT answer with the tokenizer's EOS token.")
    max_length: PositiveInt = Field(1024, le=1 << 22, description="Longest sequence in tokens.")

    @model_validator(mode="after")
    def _taskset_named(self) -> VerifiersTasksArgs:
        if not isinstance(self.taskset.get("id"), str) or not self.taskset.get("id"):
            raise ValueError(
                "taskset needs its id: the module that exports the Taskset (e.g. {id: my_tasks})"
            )
        return self
