"""spawn_procs(bootstrap=...) with an async function: it runs in each new process before the mesh is handed
out, and may await actor calls there."""
import os

from monarch.actor import Actor, endpoint, this_host, this_proc


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.value = start

    @endpoint
    def incr(self) -> None:
        self.value += 1

    @endpoint
    def get(self) -> int:
        return self.value


class Reader(Actor):
    @endpoint
    def bootstrapped(self) -> str:
        return os.environ.get("BOOTSTRAPPED", "no")


async def setup() -> None:
    helper = this_proc().spawn("helper", Counter, 5)
    await helper.incr.call()
    os.environ["BOOTSTRAPPED"] = f"counter at {await helper.get.call_one()}"


procs = this_host().spawn_procs(per_host={"gpus": 2}, bootstrap=setup)
reader = procs.spawn("reader", Reader)
for point, seen in sorted(reader.bootstrapped.call().get().items(), key=lambda item: str(item[0])):
    print(point, seen)
procs.stop().get()
