"""Which host names mean this machine: one rule for the key a client sends (`areal chat URL`), the
servers' listen checks and what a published model card may show.

Layer 0: standard library only.
"""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str | None) -> bool:
    """Whether `host` (a URL's host name) can only mean this machine: `localhost`, an address in
    127.0.0.0/8 or ::1 (also IPv4-mapped). Other names are not looked up: one that resolves to this
    machine today may not tomorrow, so it counts as another machine."""
    if not host:
        return False
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)
