"""Hosts' workers (Monarch's `run_worker_loop_forever` and `attach_to_workers`): real worker processes on a
Unix socket and on TCP ports, the key that admits clients over TCP, and what a worker refuses."""

import asyncio
import os
import socket
import stat
import subprocess
import sys
from typing import Any, cast

import cloudpickle
import pytest
from conftest import wait_until

from monarch_kernel.agent.worker import _SocketStreams
from monarch_kernel.core.errors import MeshStartError
from monarch_kernel.core.worker_key import WorkerKeyError, worker_key, worker_key_path
from monarch_kernel.monarch.actor import Actor, attach_to_workers, endpoint
from monarch_kernel.monarch.job import LoginJob, ProcessState
from monarch_kernel.wire.handshake_gate import HandshakeGate

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks cannot import this file
CA = "trust_all_connections"


class Where(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _answers(address: str) -> bool:
    if address.startswith("ipc://"):
        return os.path.exists(address[len("ipc://"):])
    host, port = address[len("tcp://"):].split("@")[0].rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def start_worker(tmp_path):
    """Start worker processes (each torn down after the test); returns a function of the address."""
    started = []

    def start(address: str, env: dict | None = None, dial: str | None = None) -> subprocess.Popen:
        code = ("from monarch_kernel.monarch.actor import run_worker_loop_forever; "
                f"run_worker_loop_forever(address={address!r}, ca={CA!r})")
        worker = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **(env or {})},
                                  stderr=open(tmp_path / f"worker-{len(started)}.log", "wb"))
        started.append(worker)
        assert wait_until(lambda: _answers(dial or address) or worker.poll() is not None, 30)
        assert worker.poll() is None, (tmp_path / f"worker-{len(started) - 1}.log").read_text()
        return worker

    yield start
    for worker in started:
        worker.kill()
        worker.wait()


@pytest.mark.timeout(180)
def test_workers_on_a_unix_socket_and_on_a_tcp_port_serve_meshes_until_a_client_shuts_them_down(start_worker,
                                                                                                tmp_path):
    unix = f"ipc://{tmp_path}/worker0"
    tcp = f"tcp://127.0.0.1:{_free_port()}"
    workers = [start_worker(unix), start_worker(tcp)]
    assert stat.S_IMODE(os.stat(tmp_path / "worker0").st_mode) == 0o600  # only its user may connect

    hosts = attach_to_workers(ca=CA, workers=[unix, tcp])
    assert hosts.initialized.get() is True and hosts.extent == {"hosts": 2}
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    pids = procs.spawn("where", Where).pid.call().get()
    assert [point["hosts"] for point, _ in pids.items()] == [0, 0, 1, 1] and len(set(pids.values())) == 4
    hosts.stop().get()  # the processes end; the workers wait for more
    assert wait_until(lambda: not any(_running(pid) for pid in pids.values()), 30)

    again = attach_to_workers(ca=CA, workers=[tcp, unix])  # another client
    more = again.spawn_procs().spawn("again", Where).pid.call().get()
    assert len(set(more.values())) == 2
    again.shutdown().get()  # as Monarch's: the workers end too
    assert all(worker.wait(timeout=30) == 0 for worker in workers)
    assert not (tmp_path / "worker0").exists() and not any(_running(pid) for pid in more.values())


@pytest.mark.timeout(120)
def test_a_worker_takes_a_listening_socket_it_inherits_and_an_alias_it_binds_elsewhere(start_worker):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    inherited = f"tcp://127.0.0.1:{port}"
    code = ("from monarch_kernel.monarch.actor import run_worker_loop_forever; "
            f"run_worker_loop_forever(address='tcp://127.0.0.1:fd{listener.fileno()}', ca={CA!r})")
    worker = subprocess.Popen([sys.executable, "-c", code], pass_fds=[listener.fileno()])
    listener.close()
    try:
        alias_port = _free_port()
        alias = f"tcp://127.0.0.1:{alias_port}@tcp://0.0.0.0:{alias_port}"
        start_worker(alias, dial=alias)
        hosts = attach_to_workers(ca=CA, workers=[inherited, alias])
        assert len(set(hosts.spawn_procs().spawn("both", Where).pid.call().get().values())) == 2
        hosts.shutdown().get()
        assert worker.wait(timeout=30) == 0
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.timeout(120)
def test_a_tcp_worker_admits_only_clients_with_its_users_key(start_worker, tmp_path, monkeypatch):
    tcp = f"tcp://127.0.0.1:{_free_port()}"
    worker = start_worker(tcp, env={"XDG_STATE_HOME": str(tmp_path / "worker-state")})  # a key of its own
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "client-state"))
    hosts = attach_to_workers(ca=CA, workers=[tcp])
    assert hosts.initialized.get() is True  # it is there...
    with pytest.raises(MeshStartError, match="did not admit us .*the same worker key"):
        hosts.spawn_procs()  # ...but it does not take work from us
    hosts.shutdown().get()  # nor an order to end (refused once the worker checked our proof)
    assert worker.poll() is None
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "worker-state"))  # now with the worker user's key
    again = attach_to_workers(ca=CA, workers=[tcp])
    assert len(list(again.spawn_procs().spawn("keyed", Where).pid.call().get().values())) == 1
    again.shutdown().get()
    assert worker.wait(timeout=30) == 0
    assert "refused 1 connection(s) that did not prove the key" in (tmp_path / "worker-0.log").read_text()


@pytest.mark.timeout(120)
def test_a_flood_of_silent_connections_from_one_machine_does_not_shut_out_another(start_worker):
    port = _free_port("0.0.0.0")
    start_worker(f"tcp://0.0.0.0:{port}", dial=f"tcp://127.0.0.1:{port}")
    flood = []
    for _ in range(40):  # from 127.0.0.2: past its share, the worker closes the oldest at once
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        flood.append(sock)

    def closed() -> int:
        count = 0
        for sock in flood:
            try:
                count += sock.recv(1) == b""
            except BlockingIOError:
                pass  # still open
            except OSError:
                count += 1
        return count

    try:
        assert wait_until(lambda: closed() >= 40 - 8, 30)  # the worker took them all (its share of 8 waits)
        hosts = attach_to_workers(ca=CA, workers=[f"tcp://127.0.0.1:{port}"])  # another machine gets in
        assert len(list(hosts.spawn_procs().spawn("through", Where).pid.call().get().values())) == 1
        hosts.stop().get()
    finally:
        for sock in flood:
            sock.close()


def test_a_worker_that_does_not_answer_is_named_and_a_bad_address_is_refused(tmp_path):
    gone = f"ipc://{tmp_path}/never_bound"
    hosts = attach_to_workers(ca=CA, workers=[gone])
    with pytest.raises(MeshStartError, match=rf"attach failed: .*{tmp_path}/never_bound.*run_worker_loop_forever"):
        hosts.initialized.get()
    with pytest.raises(ValueError, match="use ipc://PATH, tcp://HOST:PORT"):
        attach_to_workers(ca=CA, workers=["http://node7"])
    with pytest.raises(NotImplementedError, match="worker key"):
        attach_to_workers(ca="/etc/ca.pem", workers=[gone])


def test_the_worker_key_is_made_once_private_and_never_read_through_a_link(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    key = worker_key()
    assert len(key) == 32 and worker_key() == key
    assert stat.S_IMODE(os.stat(worker_key_path()).st_mode) == 0o600
    os.chmod(worker_key_path(), 0o644)
    with pytest.raises(WorkerKeyError, match="not a private file"):
        worker_key()
    os.unlink(worker_key_path())
    (tmp_path / "elsewhere").write_text(os.urandom(32).hex())
    os.chmod(tmp_path / "elsewhere", 0o600)
    os.symlink(tmp_path / "elsewhere", worker_key_path())
    with pytest.raises(WorkerKeyError, match="cannot be opened safely"):
        worker_key()


class LocalLoginJob(LoginJob):
    """A LoginJob whose "login" starts each host's worker here, on a Unix socket."""

    def __init__(self, folder):
        super().__init__()
        self._folder = folder

    def _start_host(self, host: str) -> ProcessState:
        address = f"ipc://{self._folder}/{host}"
        code = ("from monarch_kernel.monarch.actor import run_worker_loop_forever; "
                f"run_worker_loop_forever(address={address!r}, ca={CA!r})")
        return ProcessState(subprocess.Popen([sys.executable, "-c", code], start_new_session=True).pid, address)


@pytest.mark.timeout(120)
def test_a_login_job_starts_its_hosts_workers_attaches_to_them_and_kill_ends_them(tmp_path):
    job = LocalLoginJob(tmp_path)
    job.add_mesh("trainers", ["node0", "node1"])
    try:
        state = job.state(cached_path=None)
        pids = state.trainers.spawn_procs(per_host={"gpus": 1}).spawn("t", Where).pid.call().get()
        assert len(set(pids.values())) == 2
        workers = [p.pid for p in job._host_to_pid.values()]
    finally:
        job.kill()
    assert wait_until(lambda: not any(_running(pid) for pid in [*workers, *pids.values()]), 30)


def test_a_connection_the_gate_drops_leaves_the_next_one_on_its_descriptor_number_intact():
    """The gate drops a connection whose first read waits in the event loop. When the drop closed its descriptor
    at once, the next connection accepted got the same number while the loop still held the old read, so the
    newcomer's first read failed and its peer, holding the key, saw the connection reset (the flood test above
    failed so about 1 run in 10)."""

    async def main() -> None:
        gate = HandshakeGate("test", lambda line: None, per_source=1)
        dropped, dropped_peer = socket.socketpair()
        dropped.setblocking(False)
        first = _SocketStreams(dropped)
        gate.admit(cast(Any, first))
        waiting = asyncio.create_task(first.readexactly(1))
        await asyncio.sleep(0)  # (one turn: its read is registered in the loop)
        second = _SocketStreams(socket.socketpair()[0])  # from the same source, past the share of 1:
        gate.admit(cast(Any, second))  # the first is dropped
        newcomer, newcomer_peer = socket.socketpair()  # the next connection: the lowest free descriptor number
        newcomer.setblocking(False)
        newcomer_peer.sendall(b"k")
        assert await asyncio.wait_for(_SocketStreams(newcomer).readexactly(1), 5) == b"k"
        with pytest.raises(asyncio.IncompleteReadError):  # the dropped one's read ends as the peer's close would
            await asyncio.wait_for(waiting, 5)
        for sock in (dropped, dropped_peer, newcomer, newcomer_peer):
            sock.close()

    asyncio.run(main())
