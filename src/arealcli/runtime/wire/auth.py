"""Keys on the wire: the `Authorization: Bearer KEY` header, and the environment variables that hand a
key to a server (never its command line, which `ps` shows to every user of the machine)."""

from __future__ import annotations

API_KEY_ENV = "AREAL_API_KEY"  # `areal serve`'s key (and our SGLang wrapper's); clients send it too
ADMIN_KEY_ENV = "AREAL_ADMIN_KEY"  # `areal serve`'s key of the control endpoints
WEIGHTS_DIR_ENV = "AREAL_WEIGHTS_DIR"  # set for launched servers: the only folder weight updates load from
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own
CLUSTER_KEY_ENV = "AREALCLI_CLUSTER_KEY"  # the key of the servers a cluster launcher started (fresh per job)


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


# A launched server proves it holds the run's key before the launcher sends that key anywhere: the
# launcher asks `GET /health` with a fresh nonce in CHALLENGE_HEADER (no key), and the server answers
# with proof(key, nonce, port) in PROOF_HEADER, `port` the one it listens on. A process squatting the
# port does not know the key, so it cannot answer, and the key is never sent to it; nor can it relay the
# challenge to another server of the run (they all hold the same key): that one's proof names its own port.
CHALLENGE_HEADER = "X-Areal-Challenge"
PROOF_HEADER = "X-Areal-Proof"


def fresh_nonce() -> str:
    """A new random challenge (128 bits)."""
    import secrets

    return secrets.token_hex(16)


def proof(key: str, nonce: str, port: int | str) -> str:
    """HMAC-SHA256 of `NONCE|PORT` under `key`, hex: what a server that holds `key` and listens on `port`
    answers to `nonce`."""
    import hashlib
    import hmac

    return hmac.new(key.encode(), f"{nonce}|{int(port)}".encode(), hashlib.sha256).hexdigest()


def proves(key: str, nonce: str, port: int | str, answer: str | None) -> bool:
    """Whether `answer` is the proof of `key` for `nonce` from a server on `port` (constant-time)."""
    import hmac

    return answer is not None and hmac.compare_digest(answer.encode(), proof(key, nonce, port).encode())
