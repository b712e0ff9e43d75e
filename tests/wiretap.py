"""Someone who reads a test network: every TCP payload seen on an interface (a raw packet socket; read only).

It stands for a reader of a cluster network (a mirror port, root on a machine on the path): it sees
what crosses the wire, never what a process keeps to itself.
"""

from __future__ import annotations

import socket
import struct
import threading

ETH_P_ALL = 0x0003


class WireTap:
    """Records TCP payloads on `interface` between `__enter__` and `__exit__`, per flow and sequence number."""

    def __init__(self, interface: str):
        self.interface = interface
        self.flows: dict[tuple[str, int, str, int], dict[int, bytes]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WireTap:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
        sock.bind((self.interface, 0))
        sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._read, args=(sock,), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _read(self, sock: socket.socket) -> None:
        with sock:
            while not self._stop.is_set():
                try:
                    frame = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4, TCP
                    continue
                ihl = (frame[14] & 0x0F) * 4
                ip_total = struct.unpack("!H", frame[16:18])[0]
                tcp = 14 + ihl
                src, dst = socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34])
                sport, dport, seq = struct.unpack("!HHI", frame[tcp:tcp + 8])
                payload = frame[tcp + (frame[tcp + 12] >> 4) * 4:14 + ip_total]
                if payload:
                    self.flows.setdefault((src, sport, dst, dport), {})[seq] = payload

    def streams(self) -> list[bytes]:
        """Each flow's bytes in order (retransmissions folded)."""
        out = []
        for chunks in list(self.flows.values()):
            data, end = bytearray(), None
            for seq in sorted(chunks):
                part = chunks[seq]
                if end is not None and seq < end:
                    part = part[end - seq:]
                data += part
                end = seq + len(chunks[seq]) if end is None else max(end, seq + len(chunks[seq]))
            out.append(bytes(data))
        return out

    def seen(self, needle: bytes) -> bool:
        """Whether these bytes crossed the wire in any flow."""
        return any(needle in stream for stream in self.streams())
