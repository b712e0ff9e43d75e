"""Network addresses that name no particular interface, which the mesh must never listen on."""

from __future__ import annotations

UNSPECIFIED_ADDRESSES = frozenset({"", "0.0.0.0", "::", "*", "[::]"})


def is_unspecified(address: str | None) -> bool:
    """Whether address is empty or means "every interface" (and so cannot serve as MASTER_ADDR)."""
    return address is None or address.strip() in UNSPECIFIED_ADDRESSES
