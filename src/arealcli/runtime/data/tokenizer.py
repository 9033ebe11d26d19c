"""Tokenizers: a local HF directory, or a built-in character-level tokenizer that needs no download.

The character tokenizer is a real `PreTrainedTokenizerFast` (saved with the model; it loads exactly with
`PreTrainedTokenizerFast.from_pretrained` or `from_directory` below — transformers' `AutoTokenizer`
substitutes the model type's own class for a qwen2 model, which drops spaces): one token per printable
ASCII character plus newline, and the special tokens <pad> (id 0), <eos>, <unk>.
"""

from __future__ import annotations

import string

from arealcli.errors import UserError
from arealcli.schema.recipe import TokenizerSpec

CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def char_tokenizer(vision: bool = False):
    """The character tokenizer; with `vision`, also a vision-language model's image tokens (special
    tokens after the characters: `runtime.vision.VISION_TOKENS`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from arealcli.runtime.vision import VISION_TOKENS

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    # BPE without merges splits every string into single characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    if vision:
        tok.add_special_tokens([AddedToken(t, special=True) for t in VISION_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def from_directory(path: str):
    """The tokenizer of a local directory or Hub name, as it was saved.

    `AutoTokenizer` swaps a generic saved tokenizer (tokenizer_class TokenizersBackend, e.g. the character
    tokenizer saved with a qwen2 model) for the model type's own class, which re-derives its
    pre-tokenization (qwen2: byte-level, which drops spaces from a character vocabulary). A directory
    whose tokenizer_config.json names the generic class loads with that class, from its tokenizer.json.
    """
    import json
    from pathlib import Path

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    if config.is_file() and (Path(path) / "tokenizer.json").is_file():
        try:
            declared = json.loads(config.read_text()).get("tokenizer_class")
        except (OSError, ValueError):
            declared = None
        if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(spec: TokenizerSpec | None, fallback_path: str | None, vision: bool = False):
    """The recipe's tokenizer (`vision`: the char tokenizer with image tokens)."""
    if spec is not None and spec.kind == "char":
        return _with_template(char_tokenizer(vision), spec)
    path = spec.path if spec is not None else fallback_path
    if path is None:
        raise ValueError("no tokenizer: set `tokenizer:` in the recipe or give a model a `path`")
    try:
        tok = from_directory(path)
    except (OSError, ValueError, TypeError) as e:  # no or broken tokenizer files
        raise UserError(f"cannot load a tokenizer from {path}: {str(e).strip().splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return _with_template(tok, spec)


def _with_template(tok, spec: TokenizerSpec | None):
    if spec is not None and spec.chat_template:
        tok.chat_template = spec.chat_template
    return tok


def vocabulary_mismatch(tok, path: str) -> str | None:
    """Why the tokenizer saved with the model folder `path` differs from the run's `tok` (None when it
    does not, or when the folder keeps no tokenizer): token ids are the only thing two models share, so a
    model whose ids mean other tokens would score, follow or teach nonsense."""
    from pathlib import Path

    if not (Path(path) / "tokenizer.json").is_file() and not (Path(path) / "tokenizer_config.json").is_file():
        return None
    try:
        saved = from_directory(path)
    except (OSError, ValueError, TypeError):
        return None  # said where the folder is read, if it matters
    ours, theirs = tok.get_vocab(), saved.get_vocab()
    if ours == theirs:
        return None
    differ = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
    example = ", ".join(f"{t!r}: {ours.get(t)} vs {theirs.get(t)}" for t in differ[:3])
    return (
        f"its tokenizer ({len(theirs)} tokens, saved in {path}) is not the run's ({len(ours)} tokens): "
        f"{len(differ)} tokens differ (e.g. {example}); give the recipe the model's tokenizer "
        "(`tokenizer: {path: ...}`) or a model trained with the run's"
    )
