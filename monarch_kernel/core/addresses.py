"""Network addresses that name no particular interface, which the mesh must never listen on."""

from __future__ import annotations

import ipaddress
import socket

UNSPECIFIED_ADDRESSES = frozenset({"", "0.0.0.0", "::", "*", "[::]"})


def is_unspecified(address: str | None) -> bool:
    """Whether address is empty or means "every interface" (and so cannot serve as MASTER_ADDR)."""
    return address is None or address.strip() in UNSPECIFIED_ADDRESSES


def numeric_address(address: str) -> str:
    """The one numeric address `address` resolves to here (itself if it is one already).

    Both ends of a link must mean the same socket: a listener binds this literal and says it,
    and the peer connects to that literal only (never to its own resolution of the name,
    which may differ: dual-stack names, Debian's `127.0.1.1 hostname`, multi-homed nodes).
    """
    try:
        return str(ipaddress.ip_address(address.strip("[]")))
    except ValueError:
        pass
    infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{address} resolves to no address")
    return str(infos[0][4][0])


def is_loopback(address: str) -> bool:
    """Whether a numeric address is a loopback one (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False
