"""A PortForwarder (monarch.job) spawned on the client forwards a port of one process to a port served by
another, both ways and in order; meshes of different shapes are refused; stopping it closes the port."""
import socket
import socketserver
import threading

from monarch.actor import ActorError, this_host, this_proc
from monarch.job import PortForwarder


class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        received = bytearray()
        while chunk := conn.recv(65536):
            received += chunk
    return bytes(received)


server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
threading.Thread(target=server.serve_forever, daemon=True).start()
procs = this_host().spawn_procs(per_host={"procs": 2})
forwarder = this_proc().spawn("port_forwarder", PortForwarder)
source = free_port()
forwarder.forward.call_one(procs.slice(procs=0), server.server_address[1], procs.slice(procs=1),
                           f"127.0.0.1:{source}").get()
payload = bytes(range(256)) * 4096
back = round_trip(source, payload)
print("echoed", len(back), back == payload)
try:
    forwarder.forward.call_one(procs, 1234, procs.slice(procs=0), "127.0.0.1:5678").get()
except ActorError as error:
    print("refused:", "must have the same shape" in str(error))
forwarder.stop().get()
try:
    socket.create_connection(("127.0.0.1", source), timeout=5).close()
    print("still open")
except OSError:
    print("closed after stop")
procs.stop().get()
server.shutdown()
