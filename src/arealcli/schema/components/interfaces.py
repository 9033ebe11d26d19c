"""Argument models of the built-in model interfaces."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arealcli.schema.base import StrictModel


class SFTArgs(StrictModel):
    """Supervised fine-tuning: next-token NLL over answer tokens."""

    token_normalize_scope: Literal["global", "dp"] = Field(
        "global",
        description="Average the loss over all answer tokens of the batch (global) or per rank (dp).",
    )
