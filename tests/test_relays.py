"""Relays: agents pass the controller's broadcasts on to other agents over authenticated, sealed links.

The links' security is tested on real TCP connections (forged, altered, replayed and
cross-link frames, wrong keys); the tree on real SSH hosts in network namespaces.
"""

import asyncio
import os
import signal
import sys

import numpy as np
import pytest
from conftest import RecordingSink, wait_until
from sshhosts import SSHTestHosts, unavailable_reason

from monarch_kernel import RemoteError, ssh_mesh
from monarch_kernel.agent.relays import HOLD_S, AgentRelays, combine
from monarch_kernel.controller.relays import RelayTree
from monarch_kernel.core.status import RankStatus
from monarch_kernel.wire import messages as m
from monarch_kernel.wire import relay_messages as rm
from monarch_kernel.wire.link_crypto import Session
from monarch_kernel.wire.relay_link import (
    DOWN,
    UP,
    RelayLink,
    RelayRefused,
    handshake_as_child,
    handshake_as_parent,
    new_key,
)
from monarch_kernel.wire.serialization import seal, unseal

# ------------------------------------------------------------------ the tree


def test_the_tree_gives_the_controller_and_each_relay_at_most_branching_children():
    tree = RelayTree(32, 16)
    assert tree.needed and tree.parents[:16] == [None] * 16 and tree.parents[16:] == [0] * 16
    assert tree.below(0) == list(range(16, 32)) and tree.below(5) == [] and tree.top(20) == 0
    deep = RelayTree(300, 16)  # past 16 x 17 hosts, a third level
    assert max(len(c) for c in deep.children.values()) <= 16
    assert all(deep.top(h) < 16 for h in range(300)) and deep.parents[299] is not None
    assert deep.parents[deep.parents[299]] is not None
    chain = RelayTree(3, 1)
    assert chain.parents == [None, 0, 1] and chain.below(0) == [1, 2] and chain.routes(0) == ((1, 1), (2, 1))
    assert not RelayTree(16, 16).needed


def test_results_of_one_request_are_combined_after_every_hosts_output():
    out_a, out_b = m.Output(1, 7, "stdout", "a\n"), m.Output(3, 7, "stdout", "b\n")
    res = [m.Result(7, r, None, None, 0.0, 0.0) for r in range(4)]
    batch = [m.Gathered(7, (res[0], res[1])), out_b, m.Gathered(7, (res[2], res[3])), out_a]
    combined = combine(batch)
    assert combined[0] is out_b and combined[2] is out_a
    assert isinstance(combined[1], m.Gathered) and [r.rank for r in combined[1].results] == [0, 1, 2, 3]


def test_a_relay_sends_a_requests_results_up_once_its_subtree_answered_or_after_a_short_wait():
    async def main():
        sent, ran = [], []
        relay = AgentRelays(sent.append, ran.append)
        relay.index = 0  # a relay at the top of its tree, with one child (host 1) below it
        relay.children[1] = type("Link", (), {"send": lambda self, msg: None, "closed": False})()
        relay._routes = {1: 1}
        relay.down(rm.RelayDown(((0, (0, 1)), (1, (2, 3))), m.RunCell(5, "pass", "<cell>")))
        assert [msg.ranks for msg in ran] == [(0, 1)]
        result = [m.Result(5, r, None, None, 0.0, 0.0) for r in range(4)]
        relay.up(m.Gathered(5, tuple(result[:2])))  # its own ranks
        await asyncio.sleep(0)
        assert sent == []  # waiting for the child's
        relay.up(m.Gathered(5, tuple(result[2:])))
        await asyncio.sleep(0)
        assert [[r.rank for r in g.results] for up in sent for g in up.msgs] == [[0, 1, 2, 3]]  # one set
        sent.clear()
        relay.down(rm.RelayDown(((0, (0, 1)), (1, (2, 3))), m.RunCell(6, "pass", "<cell>")))
        relay.up(m.Gathered(6, tuple(m.Result(6, r, None, None, 0.0, 0.0) for r in (0, 1))))
        await asyncio.sleep(HOLD_S * 3)  # host 1's ranks died: what is in goes up after the short wait
        assert [[r.rank for r in g.results] for up in sent for g in up.msgs] == [[0, 1]]

    asyncio.run(main())


# ------------------------------------------------------------------ the links


class Pair:
    """A parent and a child end of one relay link on a real TCP connection (127.0.0.1)."""

    def __init__(self):
        self.at_parent, self.at_child = [], []
        self.closed_parent, self.closed_child = asyncio.Event(), asyncio.Event()
        self.why_parent = self.why_child = None

    async def open(self, key_parent: bytes, key_child: bytes, index: int = 3):
        accepted = asyncio.get_running_loop().create_future()

        async def accept(reader, writer):
            try:
                accepted.set_result((reader, writer, *await handshake_as_parent(reader, writer, key_parent)))
            except RelayRefused as exc:
                accepted.set_exception(exc)
                writer.close()

        self.server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        self.child_streams = (reader, writer)
        child_session = await handshake_as_child(reader, writer, key_child, index)
        p_reader, p_writer, got_index, parent_session = await accepted
        self.index = got_index
        self.parent = RelayLink(p_reader, p_writer, parent_session, DOWN, self.at_parent.append, self._parent_closed)
        self.child = RelayLink(reader, writer, child_session, UP, self.at_child.append, self._child_closed)
        return self

    def _parent_closed(self, why):
        self.why_parent = why
        self.closed_parent.set()

    def _child_closed(self, why):
        self.why_child = why
        self.closed_child.set()

    async def close(self):
        self.parent.close()
        self.child.close()
        self.server.close()


async def until(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_frames_flow_both_ways_in_order():
    async def main():
        pair = await Pair().open(key := new_key(), key, index=7)
        assert pair.index == 7
        payload = np.arange(1 << 18, dtype=np.int64)  # 2 MiB as an out-of-band buffer
        for i in range(3):
            pair.parent.send(rm.RelayDown(((7, (i,)),), m.Ping(i)))
        pair.child.send(rm.RelayUp((m.Output(1, None, "stdout", "hi"),)))
        pair.parent.send(rm.RelayDown(((7, (0,)),), m.Push(1, seal({"x": payload}))))
        await until(lambda: len(pair.at_child) == 4 and pair.at_parent)
        assert [msg.hosts[0][1] for msg in pair.at_child[:3]] == [(0,), (1,), (2,)]
        assert np.array_equal(unseal(pair.at_child[3].body.values)["x"], payload)
        assert pair.at_parent[0].msgs[0].text == "hi"
        await pair.close()

    asyncio.run(main())


def test_a_peer_without_the_key_is_refused_both_ways():
    async def main():
        with pytest.raises(RelayRefused, match="did not prove"):
            await Pair().open(new_key(), new_key())

    asyncio.run(main())


def _raw_frames(link_writer_target):
    """Record what one end writes, to replay or alter it."""
    recorded = []
    original = link_writer_target._writer.writelines

    def recording(parts):
        parts = [bytes(p) for p in parts]
        recorded.append(b"".join(parts))
        original(parts)

    link_writer_target._writer.writelines = recording
    return recorded


async def one_delivered_frame(pair) -> bytes:
    """The bytes of one frame the parent sent and the child took."""
    frames = _raw_frames(pair.parent)
    pair.parent.send(rm.RelayStop())
    await until(lambda: len(pair.at_child) == 1)
    return frames[0]


def test_a_replayed_frame_is_refused_and_closes_the_link():
    async def main():
        pair = await Pair().open(key := new_key(), key)
        pair.parent._writer.write(await one_delivered_frame(pair))  # the same bytes again
        await asyncio.wait_for(pair.closed_child.wait(), 5)
        assert isinstance(pair.why_child, RelayRefused) and "replayed" in str(pair.why_child)  # (its nonce is spent)
        assert len(pair.at_child) == 1  # the copy was not delivered
        await pair.close()

    asyncio.run(main())


def test_a_forged_or_altered_frame_is_refused_and_closes_the_link():
    async def main():
        pair = await Pair().open(key := new_key(), key)
        forged = bytearray(await one_delivered_frame(pair))
        forged[-1] ^= 1  # one bit of the ciphertext's tag flipped
        forged[8] ^= 1  # and one of the ciphertext
        pair.parent._writer.write(bytes(forged))
        await asyncio.wait_for(pair.closed_child.wait(), 5)
        assert isinstance(pair.why_child, RelayRefused) and "tag" in str(pair.why_child)
        assert len(pair.at_child) == 1
        await pair.close()

    asyncio.run(main())


def test_a_frame_recorded_on_one_link_is_refused_on_another():
    async def main():
        key = new_key()
        first, second = await Pair().open(key, key), await Pair().open(key, key)
        second.parent._writer.write(await one_delivered_frame(first))  # right number (1), right key, other link's session
        await asyncio.wait_for(second.closed_child.wait(), 5)
        assert isinstance(second.why_child, RelayRefused) and second.at_child == []
        await first.close()
        await second.close()

    asyncio.run(main())


# ------------------------------------------------------------------ on real hosts

@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    with SSHTestHosts(3, str(tmp_path_factory.mktemp("relays"))) as test_hosts:
        yield test_hosts


def chain(hosts, name):
    """Three hosts relayed in a chain (branching 1): the controller sends to host 0 only."""
    return ssh_mesh([h.alias for h in hosts.hosts], gpus=2, dist="none", python=sys.executable, preload=[],
                    connect_options=hosts.connect_options(), name=name, relay_branching=1)


@pytest.mark.timeout(180)
def test_cells_pushes_and_pulls_go_through_the_relays(hosts):
    mesh = chain(hosts, "relayed")
    try:
        assert mesh._runtime.relays.active
        sink = RecordingSink()
        values = mesh.run("import os\nprint('on', os.getpid())\n21 * 2", sink=sink)
        assert list(values.values()) == [42] * 6 and all(sink.text()[r].startswith("on ") for r in range(6))
        before = mesh._runtime.bytes_sent()
        payload = np.arange(8 << 20, dtype=np.uint8)  # 8 MiB
        mesh.push(x=payload)
        sent = {name: mesh._runtime.bytes_sent()[name] - before[name] for name in before}
        first, *others = [h.alias for h in hosts.hosts]
        assert sent[first] >= payload.nbytes and all(sent[o] < 1 << 16 for o in others), sent  # one copy left us
        assert set(mesh.pull("int(x.sum() % 1000003)").values()) == {int(payload.sum() % 1000003)}
        assert mesh.slice(hosts=2, gpus=1).run("x.nbytes").item() == payload.nbytes  # one host deep in the tree
        lines = mesh.run("for i in range(300):\n    print('line', i)\n'done'", sink=(sink := RecordingSink()))
        assert set(lines.values()) == {"done"} and all(sink.text()[r].count("line") == 300 for r in range(6))
    finally:
        mesh.shutdown()


@pytest.mark.timeout(180)
def test_a_lost_relay_agent_cuts_off_its_subtree_and_the_rest_goes_on(hosts):
    mesh = chain(hosts, "relay-loss")
    try:
        agent = int(mesh.slice(hosts=1, gpus=0).run("import os\nos.getppid()").item())  # host 1 relays to host 2
        os.kill(agent, signal.SIGKILL)
        lost = {hosts.hosts[1].alias, hosts.hosts[2].alias}
        assert wait_until(lambda: all(s.state == RankStatus.DEAD for s in mesh.status() if s.host in lost), 30)
        assert all(s.state != RankStatus.DEAD for s in mesh.status() if s.host == hosts.hosts[0].alias), \
            [(s.rank, s.exit_text) for s in mesh.status()]
        assert list(mesh.slice(hosts=0).run("1 + 1").values()) == [2, 2]  # the rest of the mesh keeps working
        with pytest.raises(RemoteError, match="cut off"):
            mesh.run("1")
        assert wait_until(lambda: not _agents_left(hosts, 2), 20)  # the cut-off host's agent was told to stop
        mesh.restart()  # rebuilds every host and the tree
        assert mesh._runtime.relays.active and list(mesh.run("3").values()) == [3] * 6
    finally:
        mesh.shutdown()


@pytest.mark.timeout(120)
def test_hosts_that_cannot_reach_each_other_run_without_relays_and_say_so(hosts, capsys):
    import subprocess

    route = ["ip", "netns", "exec", hosts.hosts[1].netns, "ip", "route"]
    subprocess.run([*route, "add", "blackhole", f"{hosts.hosts[0].address}/32"], check=True)  # 1 cannot reach 0
    try:
        mesh = chain(hosts, "relay-unreachable")
        try:
            assert not mesh._runtime.relays.active
            assert "could not be set up" in capsys.readouterr().err
            listening = ["ip", "netns", "exec", hosts.hosts[0].netns, "ss", "-ltnH"]
            assert wait_until(lambda: all(":22 " in line for line in subprocess.run(
                listening, capture_output=True, text=True, check=True).stdout.splitlines()), 5)  # relay closed
            assert list(mesh.run("6 * 7", sink=RecordingSink()).values()) == [42] * 6  # every host, directly
        finally:
            mesh.shutdown()
    finally:
        subprocess.run([*route, "del", "blackhole", f"{hosts.hosts[0].address}/32"], check=True)


def _agents_left(hosts, index):
    found = []
    for pid in hosts.pids(hosts.hosts[index]):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"monarch_kernel.agent" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def test_a_relay_refuses_strangers_and_stops_listening_once_its_children_joined():
    async def main():
        reported = []
        relay = AgentRelays(reported.append, lambda msg: None)
        key = new_key()
        serving = asyncio.get_running_loop().create_task(
            relay.serve(rm.RelayServe(key, "127.0.0.1", 0, (1,), ((1, 1),))))
        await until(lambda: reported)
        port = reported[0].port
        assert port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a stranger, with another key
        with pytest.raises(RelayRefused):
            await handshake_as_child(reader, writer, new_key(), 1)
        writer.close()
        assert relay.children == {}
        child = AgentRelays(reported.append, lambda msg: None)
        await child.join(rm.RelayJoin("127.0.0.1", port, key, 1))
        assert reported[-1] == rm.RelayJoined(1)
        await until(lambda: 1 in relay.children)
        await asyncio.wait_for(serving, 5)  # every child joined: the relay stopped listening
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        relay.stop()
        child.stop()

    asyncio.run(main())


def test_many_strangers_do_not_stop_a_relay_before_its_child_joins():
    """N11: 16 strangers in 10 ms made the relay stop listening; the real child could not join."""
    async def main():
        reported = []
        relay = AgentRelays(reported.append, lambda msg: None)
        key = new_key()
        serving = asyncio.get_running_loop().create_task(
            relay.serve(rm.RelayServe(key, "localhost", 0, (1,), ((1, 1),))))
        await until(lambda: reported)
        listening = reported[0]
        assert listening.port and listening.address in ("127.0.0.1", "::1")  # the literal it bound
        for _ in range(40):
            reader, writer = await asyncio.open_connection(listening.address, listening.port)
            with pytest.raises(RelayRefused):
                await handshake_as_child(reader, writer, new_key(), 1)
            writer.close()
        child = AgentRelays(reported.append, lambda msg: None)
        await child.join(rm.RelayJoin(listening.address, listening.port, key, 1))
        assert reported[-1] == rm.RelayJoined(1)
        await asyncio.wait_for(serving, 5)
        relay.stop()
        child.stop()

    asyncio.run(main())


def test_a_frame_header_alone_does_not_make_a_link_allocate_what_it_names():
    """N13: a sealed link allocated a header's announced length before any byte (or the MAC) arrived.
    Records now carry at most 1 MiB each, checked by their tags before a frame grows."""
    import tracemalloc

    from monarch_kernel.wire.link_crypto import RECORD_HEADER

    async def main():
        closed = []
        server_side = asyncio.get_running_loop().create_future()

        async def accept(reader, writer):
            server_side.set_result((reader, writer))

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, peer = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = await server_side
        tracemalloc.start()
        RelayLink(reader, writer, Session(new_key(), new_key()), DOWN, lambda msg: None, closed.append)
        peer.write(RECORD_HEADER.pack(512 << 20, 1) + b"x" * 1024)  # announces 512 MiB, sends 1 KiB
        await peer.drain()
        await asyncio.sleep(0.1)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        peer.close()
        await until(lambda: closed)
        server.close()
        return peak

    assert asyncio.run(main()) < 64 << 20
