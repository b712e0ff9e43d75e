"""Listeners anyone can reach keep a bounded number of connections in their handshake (N17).

A real relay-link listener with the gate in front: crowds of silent connections, from one address
and from several, never hold more than the caps, the peer with the key still gets in, and the
refusals make one line per window.
"""

import asyncio
import resource
import subprocess
import sys

from monarch_kernel.wire.handshake_gate import HandshakeGate
from monarch_kernel.wire.relay_link import RelayRefused, handshake_as_child, handshake_as_parent, new_key


async def _serve(gate: HandshakeGate, key: bytes, proved: list[int]):
    async def accept(reader, writer):
        token = gate.admit(writer)
        try:
            index, _ = await handshake_as_parent(reader, writer, key)
        except RelayRefused as exc:
            gate.refuse(token, str(exc))
            return
        gate.done(token)
        proved.append(index)

    return await asyncio.start_server(accept, "127.0.0.1", 0)


async def _open_silent(count: int, port: int, source: str):
    opened = []
    for _ in range(count):
        opened.append(await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)))
    return opened


def test_silent_crowds_stay_within_the_caps_and_the_key_holder_still_gets_in():
    async def main():
        lines: list[str] = []
        gate = HandshakeGate("test listener", lines.append, max_pending=16, per_source=4, window=60)
        key, proved = new_key(), []
        server = await _serve(gate, key, proved)
        port = server.sockets[0].getsockname()[1]
        crowd = await _open_silent(50, port, "127.0.0.1")  # one address
        crowd += await _open_silent(30, port, "127.0.0.2")
        crowd += await _open_silent(30, port, "127.0.0.3")
        crowd += await _open_silent(30, port, "127.0.0.4")
        crowd += await _open_silent(30, port, "127.0.0.5")
        await asyncio.sleep(0.2)  # (the server's accepts run)
        sources = [src for src, _ in gate._pending.values()]
        assert len(sources) <= 16 and all(sources.count(s) <= 4 for s in set(sources)), sources
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # the peer with the key, last in line
        await handshake_as_child(reader, writer, key, 7)
        for _ in range(100):
            if proved:
                break
            await asyncio.sleep(0.01)
        assert proved == [7]
        assert gate.refused >= 170 - 16 and len(lines) == 1, lines  # one line now; the rest wait for the window
        gate.close()  # the listener closes: the rest of the window's count is said
        assert len(lines) == 2 and "refused" in lines[1] and "in the last 60 s" in lines[1]
        for _, w in crowd:
            w.close()
        writer.close()
        server.close()

    asyncio.run(main())


def test_a_summary_line_comes_when_the_window_ends_without_another_refusal():
    async def main():
        lines: list[str] = []
        gate = HandshakeGate("test listener", lines.append, max_pending=16, per_source=2, window=0.3)
        server = await _serve(gate, new_key(), [])
        port = server.sockets[0].getsockname()[1]
        crowd = await _open_silent(10, port, "127.0.0.1")
        for _ in range(200):
            if len(lines) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(lines) == 2 and "refused 7 connection(s)" in lines[1], lines
        for _, w in crowd:
            w.close()
        gate.close()
        server.close()

    asyncio.run(main())


def test_agents_and_ranks_lift_the_soft_descriptor_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = ("import resource\nfrom monarch_kernel.wire.handshake_gate import raise_descriptor_limit\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
            "raise_descriptor_limit()\nprint(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == (hard if hard != resource.RLIM_INFINITY else 1 << 20) and int(out[1]) == hard
