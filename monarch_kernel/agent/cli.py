"""The agent's command line: `python -m monarch_kernel.agent (--fd N | --stdio [--munge | --pinned KEY]
[--direct ADDR]) --host NAME`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import socket
import sys
from collections.abc import Callable
from functools import partial

from monarch_kernel.agent import direct_link
from monarch_kernel.agent.descendants import become_subreaper, reap_adopted
from monarch_kernel.agent.direct_link import parse_environment, read_fd_exact, read_line
from monarch_kernel.agent.host_agent import HostAgent
from monarch_kernel.agent.watchers import send_heartbeats, watch_controller, watch_ranks
from monarch_kernel.core.folders import owned_folder, remove_if_orphaned
from monarch_kernel.wire.handshake_gate import raise_descriptor_limit
from monarch_kernel.wire.link_crypto import KEY_BYTES, Session
from monarch_kernel.wire.persist_messages import ENDED_WITHOUT_KERNEL
from monarch_kernel.wire.pinned_auth import PinnedKeyRefused, PinnedOffer, parse_public
from monarch_kernel.wire.relay_link import UP, RelayLink, pipe_streams
from monarch_kernel.wire.transport import AsyncConnection

MAX_ENV_BYTES = 64 << 20


def _read_env_line(fd: int) -> dict[str, str]:
    """The environment from fd: a line with its length, then that many bytes of JSON (what follows
    is the controller's frames, or the direct link's secret)."""
    header = read_line(fd, limit=32)
    if not header:
        raise SystemExit("monarch_kernel agent: stdin closed before the environment arrived")
    try:
        size = int(header)
    except ValueError:
        raise SystemExit("monarch_kernel agent: the environment's length line is not a number "
                         "(another monarch_kernel version on the notebook's side?)") from None
    if not 0 <= size <= MAX_ENV_BYTES:
        raise SystemExit(f"monarch_kernel agent: an environment of {size} bytes is over {MAX_ENV_BYTES}")
    try:
        data = read_fd_exact(fd, size)
    except EOFError:
        raise SystemExit("monarch_kernel agent: stdin closed in the middle of the environment") from None
    return parse_environment(data)


def _read_session(fd: int) -> Session:
    """The link keys a worker wrote on a pipe (down, then up)."""
    with os.fdopen(fd, "rb") as pipe:
        keys = pipe.read(2 * KEY_BYTES)
    if len(keys) != 2 * KEY_BYTES:
        raise SystemExit("monarch_kernel agent: the worker's link keys were cut short")
    return Session(keys[:KEY_BYTES], keys[KEY_BYTES:])


def _warm_imports() -> None:
    """Import what every rank needs before forking them (torch, when wanted, comes with `Preload`)."""
    import cloudpickle  # noqa: F401

    from monarch_kernel.rank import capture, cell, dist, worker  # noqa: F401

    gc.collect()  # see agent.preload: forked ranks share what is frozen here
    gc.freeze()


def _on_signal(agent: HostAgent, signum: int) -> None:
    asyncio.get_running_loop().create_task(agent.shutdown(signal.Signals(signum).name))


def _private_stdio() -> tuple[int, int]:
    """The channel on stdin/stdout, moved to private descriptors: nothing a library prints can corrupt it."""
    read_fd, write_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    return read_fd, write_fd


def _watch_step_input(agent: HostAgent, read_fd: int) -> None:
    """On a direct link the step's stdin stays open until the controller goes: its end stops the agent."""
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(read_fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(read_fd)
            agent.on_controller_closed(ConnectionError("the job step's stdin closed"))

    os.set_blocking(read_fd, False)
    loop.add_reader(read_fd, readable)


async def _amain(args: argparse.Namespace, stdio: tuple[int, int] | None,
                 step_link: direct_link.StepLink | None, session: Session | None = None) -> bool:
    """Serve until the agent ends; whether it ended with no kernel holding its (persistent) mesh."""
    agent = HostAgent(args.host, tuple(args.mesh_folder) if args.persist else ())
    loop = asyncio.get_running_loop()
    if step_link is not None and stdio is not None:
        # every frame an AES-GCM record under the munge-authenticated exchange's keys (agent/direct_link.py)
        if step_link.sock is not None:
            step_link.sock.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=step_link.sock, limit=1 << 22)
        else:
            reader, writer = await pipe_streams(*stdio)
        agent.connected(RelayLink(reader, writer, (step_link.sealer, step_link.opener), UP,
                                  agent.on_controller_message, agent.on_controller_closed))
        if step_link.sock is not None:
            _watch_step_input(agent, stdio[0])
    elif stdio is not None:
        agent.connected(await AsyncConnection.from_pipes(
            *stdio, agent.on_controller_message, agent.on_controller_closed))
    elif session is not None:  # a worker admitted this client over TCP: sealed records (agent/worker.py)
        sock = socket.socket(fileno=args.fd)
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 22)
        agent.connected(RelayLink(reader, writer, session, UP, agent.on_controller_message,
                                  agent.on_controller_closed))
    else:
        sock = socket.socket(fileno=args.fd)
        agent.connected(await AsyncConnection.from_socket(
            sock, agent.on_controller_message, agent.on_controller_closed))
    # (a persistent mesh's agent outlives the SSH session that started it: a hang-up is not the end)
    for sig in (signal.SIGTERM,) if args.persist else (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, partial(_on_signal, agent, sig))
    # helpers the ranks started in sessions of their own are re-parented to us when their rank
    # dies (we are their subreaper): reap them as they end (the ranks' own exits come by pidfd)
    loop.add_signal_handler(signal.SIGCHLD, lambda: reap_adopted(agent.ranks.pids()))
    watchers = [loop.create_task(watch_ranks(agent)), loop.create_task(send_heartbeats(agent))]
    if args.stdio:  # over SSH a cut network may never close the channel: watch for silence
        watchers.append(loop.create_task(watch_controller(agent)))
    await agent.done
    for task in watchers:
        task.cancel()
    return agent.ended_without_kernel


def main(argv: list[str] | None = None) -> None:
    """Agent entry point."""
    parser = argparse.ArgumentParser(description="monarch_kernel host agent")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="inherited socket to the controller")
    where.add_argument("--stdio", action="store_true", help="talk to the controller on stdin/stdout (SSH)")
    parser.add_argument("--host", default=socket.gethostname())
    parser.add_argument("--cleanup", default=None, help="a folder to remove when the agent exits")
    parser.add_argument("--log-folder", default=None, metavar="PATH",
                        help="the folder of this agent's log (a Ray slot's): removed when the agent ends after serving "
                             "its controller, kept when it fails before (its starter shows the log's end)")
    parser.add_argument("--mesh-folder", action="append", default=[], metavar="PATH",
                        help="a folder of the kernel's mesh: removed as the agent exits if the kernel is gone")
    parser.add_argument("--persist", action="store_true",
                        help="the mesh may outlive its kernel: do not die with the process that started us")
    parser.add_argument("--env-stdin", action="store_true", help="read the environment from stdin first (JSON line)")
    parser.add_argument("--munge", action="store_true",
                        help="with --stdio (a Slurm step): key an encrypted link with munge credentials; the "
                             "environment comes encrypted on it")
    parser.add_argument("--pinned", default=None, metavar="KEY",
                        help="with --stdio (a Ray node): key the encrypted link with the controller's public KEY "
                             "(hex), carried by Ray; the agent's own goes out in its offer line")
    parser.add_argument("--session-fd", type=int, default=None, metavar="FD",
                        help="with --fd (a worker's client over TCP): read the link's keys from this pipe")
    parser.add_argument("--direct", default=None, metavar="ADDRESS",
                        help="with --munge or --pinned: offer that link over TCP on ADDRESS (else it stays on the "
                             "step's stdio)")
    args = parser.parse_args(argv)
    raise_descriptor_limit()  # (the ranks fork from us and keep it)
    if args.munge and not args.stdio:
        parser.error("--munge needs --stdio")
    if args.pinned and (not args.stdio or args.munge):
        parser.error("--pinned needs --stdio, and not --munge")
    if args.direct and not (args.munge or args.pinned):
        parser.error("--direct needs --munge or --pinned")
    if args.session_fd is not None and args.fd is None:
        parser.error("--session-fd needs --fd")
    session = _read_session(args.session_fd) if args.session_fd is not None else None
    if args.env_stdin:
        os.environ.update(_read_env_line(0))
    stdio = _private_stdio() if args.stdio else None
    step_link = None
    if (args.munge or args.pinned) and stdio is not None:
        make: Callable[[], direct_link.LinkOffer] = direct_link.Offer
        if args.pinned:
            try:
                controller_key = parse_public(args.pinned)
            except PinnedKeyRefused as exc:
                parser.error(f"--pinned: {exc}")
            make = lambda: PinnedOffer(controller_key)  # noqa: E731
        step_link = direct_link.offer(*stdio, args.direct, make)
        os.environ.update(step_link.read_environment(stdio[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts come as messages, not signals
    from monarch_kernel.rank.entry import die_with_parent

    if not args.persist:  # (a persistent mesh hears of its kernel's end on the link, and waits for the next)
        die_with_parent(signal.SIGTERM)  # the kernel is gone: stop every rank's process group, then exit
    become_subreaper()  # what the ranks start stays below us, however it detaches (agent/descendants.py)
    if args.cleanup:  # whoever ships the next copy removes this one if we die without cleaning up
        owned_folder(args.cleanup, remove_on_failure=False)
    _warm_imports()
    served = alone = False
    try:
        alone = asyncio.run(_amain(args, stdio, step_link, session))
        served = True
    finally:
        import shutil

        if args.cleanup:
            shutil.rmtree(args.cleanup, ignore_errors=True)
        if args.log_folder and served:  # (a Ray slot killed with its placement group cannot remove it)
            shutil.rmtree(args.log_folder, ignore_errors=True)
        for folder in args.mesh_folder:  # the kernel was killed: nobody else will remove them
            remove_if_orphaned(folder)
    sys.exit(ENDED_WITHOUT_KERNEL if alone else 0)
