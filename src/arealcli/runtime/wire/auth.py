"""Keys on the wire: the `Authorization: Bearer KEY` header, and the environment variables that hand a
key to a server (never its command line, which `ps` shows to every user of the machine)."""

from __future__ import annotations

API_KEY_ENV = "AREAL_API_KEY"  # `areal serve`'s key (and our SGLang wrapper's); clients send it too
ADMIN_KEY_ENV = "AREAL_ADMIN_KEY"  # `areal serve`'s key of the control endpoints
WEIGHTS_DIR_ENV = "AREAL_WEIGHTS_DIR"  # set for launched servers: the only folder weight updates load from
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own


def fresh_key() -> str:
    """A new random key (256 bits), one per run for the servers it launches."""
    import secrets

    return secrets.token_urlsafe(32)


def bearer(key: str | None) -> dict[str, str]:
    """The request header that carries `key` ({} without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_of(header: str | None) -> str | None:
    """The key an Authorization header carries, or None."""
    return header[len("Bearer ") :] if header is not None and header.startswith("Bearer ") else None
