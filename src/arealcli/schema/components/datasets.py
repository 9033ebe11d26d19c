"""Argument models of the built-in datasets."""

from __future__ import annotations

from pydantic import Field, PositiveInt

from arealcli.schema.base import StrictModel


class PromptAnswerArgs(StrictModel):
    """JSONL rows with a prompt and an answer (extra fields are kept as metadata)."""

    path: str = Field(description="JSONL file, relative to the recipe file or absolute.")
    prompt_key: str = Field("prompt", description="Field holding the prompt text.")
    answer_key: str = Field("answer", description="Field holding the answer text (list of strings allowed).")
    max_length: PositiveInt = Field(1024, description="Prompt + answer tokens above this are truncated.")
    append_eos: bool = Field(True, description="End each answer with the tokenizer's EOS token.")
    limit: PositiveInt | None = Field(None, description="Use only the first N rows.")
