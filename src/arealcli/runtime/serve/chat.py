"""The engines `areal chat` talks to: a model folder generating in this process (`LocalChat`: the model
runner and batching scheduler of `areal serve`, without HTTP), or an OpenAI-compatible server
(`RemoteChat`: `areal serve`, vLLM, SGLang; /v1/chat/completions, /v1/completions).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from arealcli.errors import UserError
from arealcli.runtime.console.chat import ChatError, Reply, SamplingFlags
from arealcli.runtime.wire.auth import API_KEY_ENV, bearer
from arealcli.runtime.wire.hosts import is_loopback_host  # (importable from here too: serve/start.py)


class LocalChat:
    """A model folder, generating here with the scheduler of `areal serve` (torch imported on use)."""

    def __init__(self, model_dir: str, name: str, device: str = "auto", dtype: str = "float32"):
        from arealcli.runtime.generation.model_runner import ModelRunner
        from arealcli.runtime.generation.scheduler import Scheduler

        try:
            self.runner = ModelRunner(model_dir, device, dtype)
        except (OSError, ValueError, RuntimeError) as e:  # missing or broken weights, an unknown model type
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot load the model in {model_dir}: {first}") from None
        self.tokenizer = self.runner.tokenizer
        if self.tokenizer is None:
            raise UserError(f"{model_dir} has no tokenizer files: a chat needs one to read and write text")
        self.name = name
        self.chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.scheduler = Scheduler(self.runner, batch_window_s=0.0, max_batch_size=1)
        self.scheduler.start()

    def chat(self, messages: list[dict[str, Any]], sampling: SamplingFlags) -> Reply:
        from arealcli.runtime.vision import IMAGE_MARK
        from arealcli.runtime.wire.openai import ProtocolError, chat_message

        try:  # pictures (image_url parts) become marks in the text, in order
            plain = [chat_message(m, i, IMAGE_MARK) for i, m in enumerate(messages)]
        except ProtocolError as e:
            raise ChatError(str(e)) from None
        sent = [url for m in plain for url in m.pop("images", [])]
        try:
            rendered = self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (roles, order) raise
            raise ChatError(f"the chat template cannot render the conversation: {e}") from None
        if sent:
            return self._generate(*self._with_images(rendered, sent), sampling)
        return self._generate(self.tokenizer.encode(rendered, add_special_tokens=False), None, sampling)

    def complete(self, prompt: str, sampling: SamplingFlags, images: list[str] | None = None) -> Reply:
        if images:
            return self._generate(*self._with_images(prompt, images), sampling)
        return self._generate(self.runner.encode(prompt), None, sampling)

    def _with_images(self, prompt: str, sent: list[str]) -> tuple[list[int], Any]:
        from arealcli.errors import DataError

        if self.runner.images is None:
            raise ChatError(f"{self.name} does not read images (not a vision-language model)")
        try:
            return self.runner.images.request(self.tokenizer, prompt, sent)
        except DataError as e:
            raise ChatError(str(e)) from None

    def _generate(self, ids: list[int], images: Any, flags: SamplingFlags) -> Reply:
        from arealcli.runtime.generation.scheduler import Sequence
        from arealcli.runtime.wire.sglang import Sampling

        context = self.runner.context_length
        if not ids:
            raise ChatError("the message encodes to no tokens")
        if len(ids) >= context:
            raise ChatError(
                f"the prompt is {len(ids)} tokens and the model's context holds {context} "
                "(in a chat, /reset starts the conversation over)"
            )
        sampling = Sampling(
            max_new_tokens=flags.max_new_tokens, temperature=flags.temperature, top_p=flags.top_p
        )
        seq = Sequence("chat", ids, sampling, min(flags.max_new_tokens, context - len(ids)), images=images)
        self.scheduler.submit([seq])
        try:
            while not seq.done.wait(0.1):
                pass
        except KeyboardInterrupt:  # Ctrl-C: stop this reply, keep the chat
            self.scheduler.abort_all("stopped")
            seq.done.wait()
        if seq.error is not None:
            raise ChatError(seq.error)
        finish = str(seq.finished_as["type"])
        return Reply(self.runner.decode(seq.output_ids), finish, len(seq.output_ids))

    def close(self) -> None:
        self.scheduler.stop()
        self.scheduler.join(timeout=10)


FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop"}  # OpenAI's finish_reason -> ours
SEND_KEY_FLAG = "--send-key"


def key_for(url: str, send_key: bool) -> str | None:
    """The key to send to `url`: AREAL_API_KEY for a loopback URL, or any URL when `send_key` says so;
    otherwise none (a key meant for one server is never handed to whatever URL was typed)."""
    host = urlsplit(url).hostname
    return os.environ.get(API_KEY_ENV) if send_key or is_loopback_host(host) else None


def key_withheld(url: str, send_key: bool) -> bool:
    """AREAL_API_KEY is set but `key_for` does not send it to `url` (worth one line on stderr)."""
    return bool(os.environ.get(API_KEY_ENV)) and key_for(url, send_key) is None


def withheld_note(url: str) -> str:
    return (
        f"{API_KEY_ENV} is set but was not sent to {url}, which is not on this machine; pass "
        f"{SEND_KEY_FLAG} to send it there"
    )


class RemoteChat:
    """An OpenAI-compatible server: `url` is its root (http://host:port) or its /v1. AREAL_API_KEY (a
    keyed server: areal serve --api-key, vLLM --api-key) goes to a loopback URL, and to another only
    with `send_key` (`key_for`)."""

    def __init__(self, url: str, model: str | None = None, timeout_s: float = 600.0, send_key: bool = False):
        import httpx

        parts = urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"{url} is not an http(s) URL")
        root = url.rstrip("/")
        self.base = root if root.endswith("/v1") else f"{root}/v1"
        self.http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=10),
            trust_env=not is_loopback_host(parts.hostname),  # (no proxy between us and this machine)
            headers=bearer(key_for(url, send_key)),
        )
        self.model = model or self._served_model()
        self.name = f"{self.model} at {url}"
        self.chat_template = self._has_chat_template()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            r = self.http.request(method, f"{self.base}{path}", json=body)
        except httpx.HTTPError as e:
            raise UserError(f"cannot reach {self.base}{path}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise ChatError(f"{self.base}{path} answered {r.status_code}: {_error_text(r)}")
        try:
            return r.json()
        except ValueError:
            raise ChatError(f"{self.base}{path} answered with something that is not JSON") from None

    def _served_model(self) -> str:
        try:
            data = self.request("GET", "/models").get("data") or []
        except (ChatError, AttributeError) as e:
            raise UserError(f"{self.base} does not list its models (GET /v1/models): {e}") from None
        if not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise UserError(f"{self.base}/models lists no model; name one with --model")
        return str(data[0]["id"])

    def _has_chat_template(self) -> bool:
        """Whether the server renders chat messages (a one-token request; a server whose tokenizer has no
        chat template refuses it with a message saying so)."""
        try:
            self._chat([{"role": "user", "content": "hi"}], SamplingFlags(0.0, 1.0, 1))
        except ChatError as e:
            if "chat template" in str(e).lower() or "chat_template" in str(e).lower():
                return False
            raise UserError(str(e)) from None
        return True

    def chat(self, messages: list[dict[str, Any]], sampling: SamplingFlags) -> Reply:
        return self._interruptible(lambda: self._chat(messages, sampling))

    def complete(self, prompt: str, sampling: SamplingFlags, images: list[str] | None = None) -> Reply:
        if images:
            raise ChatError("pictures go in chat messages: the server's model has no chat template")
        return self._interruptible(lambda: self._complete(prompt, sampling))

    def _sampling(self, s: SamplingFlags) -> dict[str, Any]:
        return {
            "model": self.model,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }

    def _chat(self, messages: list[dict[str, Any]], s: SamplingFlags) -> Reply:
        out = self.request("POST", "/chat/completions", {"messages": messages, **self._sampling(s)})
        return _reply(out, lambda choice: (choice.get("message") or {}).get("content") or "")

    def _complete(self, prompt: str, s: SamplingFlags) -> Reply:
        out = self.request("POST", "/completions", {"prompt": prompt, **self._sampling(s)})
        return _reply(out, lambda choice: choice.get("text") or "")

    @staticmethod
    def _interruptible(ask) -> Reply:
        try:
            return ask()
        except KeyboardInterrupt:  # the request is dropped; the server finishes it on its own
            return Reply("", "abort", 0)

    def close(self) -> None:
        self.http.close()


def _reply(out: Any, text_of) -> Reply:
    try:
        choice = out["choices"][0]
        text = str(text_of(choice))
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ChatError(f"the server's answer has no choices: {str(out)[:200]}") from None
    tokens = (out.get("usage") or {}).get("completion_tokens") or 0
    return Reply(text, FINISH.get(str(choice.get("finish_reason")), "stop"), int(tokens))


def _error_text(r) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:300]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err)[:300]
    return str(err)[:300]
