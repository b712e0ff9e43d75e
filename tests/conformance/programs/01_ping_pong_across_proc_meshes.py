"""Monarch's ping-pong: actors of two proc meshes call each other, each partner picked by current_rank()."""
from monarch.actor import Actor, current_rank, endpoint, this_host


class PingPong(Actor):
    def __init__(self, name: str):
        self.name = name
        self.count = 0
        self.partner = None

    @endpoint
    async def meet(self, other) -> None:
        self.partner = other.slice(**current_rank())

    @endpoint
    async def ping(self, n: int) -> list:
        said = []
        for i in range(n):
            said.append(await self.partner.recv.call_one(f"{self.name} {dict(current_rank())} says {i}"))
        return said

    @endpoint
    async def recv(self, text: str) -> str:
        self.count += 1
        return f"{self.name} {dict(current_rank())} got [{text}] (#{self.count})"


procs_0 = this_host().spawn_procs(per_host={"gpus": 2})
procs_1 = this_host().spawn_procs(per_host={"gpus": 2})
ping = procs_0.spawn("ping", PingPong, "ping")
pong = procs_1.spawn("pong", PingPong, "pong")
ping.meet.call(pong).get()
pong.meet.call(ping).get()
for _, said in sorted(ping.ping.call(3).get().items(), key=lambda kv: str(kv[0])):
    for line in said:
        print(line)
for _, said in sorted(pong.ping.call(2).get().items(), key=lambda kv: str(kv[0])):
    for line in said:
        print(line)
