"""Errors that are the user's to fix (a recipe value, a data file, a directory): exit code 2, one message.

Raised anywhere (schema or runtime); the command layer prints the message without a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input found after the recipe validated: a data file, a model folder, a run directory.

    Given several lines, each is printed as its own error line."""

    def __init__(self, *lines: str):
        super().__init__("\n".join(lines))
        self.lines = list(lines)


class DataError(UserError):
    """A dataset file that cannot be used: names the file and, where it applies, the line."""


class TrainingDiverged(UserError):
    """A loss or gradient norm stopped being finite: training stops instead of going on with NaN."""
