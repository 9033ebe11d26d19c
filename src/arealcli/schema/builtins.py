"""The explicit table of built-in components: name -> implementation (imported lazily) + its args model.

Call types are declared here so `areal check` knows what each interface implements without importing
it; a test checks this table against the classes themselves.
"""

from __future__ import annotations

from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.datasets import PromptAnswerArgs
from arealcli.schema.components.interfaces import SFTArgs
from arealcli.schema.registry import BACKENDS, DATASETS, INTERFACES, Entry

_R = "arealcli.runtime"


def _interface(name, target, args, description, call_types, needs_model=True):
    INTERFACES.add(Entry(name, target, args, description, "builtin", frozenset(call_types), needs_model))


_interface("sft", f"{_R}.interfaces.sft:SFTInterface", SFTArgs, SFTArgs.__doc__, ["train_step"])

BACKENDS.add(Entry("hf", f"{_R}.backends.hf:HFBackend", HFBackendArgs, HFBackendArgs.__doc__, "builtin"))

PROMPT_ANSWER_KEYS = frozenset({"packed_input_ids", "prompt_mask", "packed_prompts", "prompt", "answers"})
DATASETS.add(
    Entry(
        "prompt_answer",
        f"{_R}.datasets:PromptAnswerDataset",
        PromptAnswerArgs,
        PromptAnswerArgs.__doc__,
        "builtin",
        data_keys=PROMPT_ANSWER_KEYS,
    )
)
