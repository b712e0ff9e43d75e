"""The controller's end of a Slurm agent's direct link: where to connect, and the join.

The agent offers `direct IP PORT CREDENTIAL` on the step's stdout (agent/direct_link.py): the
literal address it bound. We connect there only and send our join (`wire/munge_auth.Join`), whose
keys encrypt every later frame.
"""

from __future__ import annotations

import ipaddress
import socket

from monarch_kernel.core.addresses import is_loopback, numeric_address

DIRECT_CONNECT_TIMEOUT_S = 5.0


def direct_target(offer: list[str], node_address: str) -> tuple[str, int] | str | None:
    """Where to connect for the agent's offer `[IP, PORT]`: (ip, port); None for `none`; or why not.

    Only the literal address the agent bound is used (never our own resolution of the node's
    name), and a loopback address is refused when the node is another machine: someone else
    could hold that port here.
    """
    if offer == ["none"]:
        return None
    if len(offer) != 2 or not offer[1].isdigit():
        return f"the agent offered a direct link as {' '.join(offer)!r}, not as 'IP PORT' (another monarch_kernel version?)"
    ip, port = offer[0], int(offer[1])
    try:
        ip = str(ipaddress.ip_address(ip))
    except ValueError:
        return f"the agent offered a direct link on {ip!r}, which is not a numeric address"
    try:
        node_is_here = is_loopback(numeric_address(node_address))
    except OSError:
        node_is_here = False
    if is_loopback(ip) and not node_is_here:
        return (f"the agent listens on {ip}, a loopback address, but the node is another machine "
                "(its name resolves to a loopback address there: check /etc/hosts on the node)")
    return ip, port


def join_direct(address: str, port: int, first: bytes) -> socket.socket:
    """Connect to an agent's direct link and send the join and the first records; the socket
    (blocking; run in a thread)."""
    sock = socket.create_connection((address, port), timeout=DIRECT_CONNECT_TIMEOUT_S)
    try:
        sock.sendall(first)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
