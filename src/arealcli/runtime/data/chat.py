"""Chat formats: messages rendered with the tokenizer's chat template, and which tokens are the model's.

    render_prompt(tokenizer, messages)              a prompt's token ids, ending with the template's
                                                    generation prompt (what an instruct model expects)
    render_conversation(tokenizer, messages, ...)   a whole conversation's ids and a per-token mask that
                                                    is True on assistant tokens only (multi-turn SFT;
                                                    preference pairs: the response's only)

The assistant tokens are found from the rendered text: the conversation is rendered once, and for each
assistant message the text before it (rendered up to it, with the generation prompt) and after it
(rendered including it) bound its characters; the tokens whose characters fall there are the model's
(the fast tokenizer's offsets map tokens to characters). This works for any template that renders a
conversation as the concatenation of its turns, which the common ones (ChatML, Llama 3) do.
"""

from __future__ import annotations

from typing import Any

from arealcli.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


def messages_problem(messages: Any, key: str, parts: bool = False) -> str | None:
    """Why `messages` is not a conversation ([{role, content}, ...] with known roles), or None. With
    `parts`, a content may also be OpenAI's text and image_url parts (`images.message_parts`)."""
    if not isinstance(messages, list) or not messages:
        return f"{key!r} must be a non-empty list of {{role, content}} messages"
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if parts and isinstance(content, list):
            from arealcli.runtime.data.images import parts_problem

            problem = parts_problem(content)
            if problem:
                return f"{key!r} message {i}: {problem}"
        elif not isinstance(content, str):
            return f"{key!r} message {i} must be an object with a text `content`"
        if m.get("role") not in ROLES:
            return f"{key!r} message {i} has role {m.get('role')!r}; roles are {', '.join(ROLES)}"
    return None


def require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"the tokenizer {name} has no chat template (apply_chat_template / messages need one); use a "
            "tokenizer whose tokenizer_config.json has `chat_template`, or give text prompts without a template"
        )


def with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _text(tokenizer, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """(text, ids) of a prompt conversation followed by the generation prompt (`tools`: OpenAI function
    schemas the template renders)."""
    text = _text(tokenizer, messages, True, tools)
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def render_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, counted_from: int = 0
) -> tuple[list[int], list[bool]]:
    """(ids, loss mask) of a whole conversation: the mask is True on the tokens of assistant messages
    (their content, tool calls and the template's end of turn), False on everything else. Only the
    assistant messages from index `counted_from` on count (a preference pair: the response, not the
    assistant turns of the prompt's history)."""
    full = _text(tokenizer, messages, False, tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < counted_from:
            continue
        start = len(_text(tokenizer, messages[:i], True, tools))
        end = len(_text(tokenizer, messages[: i + 1], False, tools))
        if full[:end] != _text(tokenizer, messages[: i + 1], False, tools):
            raise DataError(
                "the chat template does not render a conversation turn by turn; cannot find its assistant tokens"
            )
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [any(s <= a and b <= e and b > a for s, e in spans) for a, b in offsets]
    return ids, mask
