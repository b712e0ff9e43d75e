"""Calls to a concurrent endpoint run beside the actor's other calls: one may wait for another."""
import asyncio

from monarch.actor import Actor, ActorError, Port, concurrent_endpoint, endpoint, this_host


class Gate(Actor):
    def __init__(self) -> None:
        self.opened = asyncio.Event()

    @concurrent_endpoint
    async def wait_open(self) -> str:
        await self.opened.wait()
        return "passed"

    @concurrent_endpoint
    async def open(self) -> None:
        self.opened.set()

    @concurrent_endpoint(explicit_response_port=True)
    async def doubled(self, port: Port[int], value: int) -> None:
        port.send(value * 2)

    @concurrent_endpoint
    async def fail(self) -> None:
        raise RuntimeError("a concurrent call failed")


class LaterGate(Gate):
    pass


for spelled in ("sync def", "on top of @endpoint"):
    try:
        if spelled == "sync def":

            class SyncOne(Actor):
                @concurrent_endpoint
                def work(self) -> None:
                    pass
        else:

            class Stacked(Actor):
                @concurrent_endpoint
                @endpoint
                async def work(self) -> None:
                    pass
        print(spelled, "accepted")
    except ValueError:
        print(spelled, "refused with ValueError")

procs = this_host().spawn_procs(per_host={"gpus": 2})
for name, cls in (("gates", Gate), ("later_gates", LaterGate)):
    gates = procs.spawn(name, cls)
    waiting = gates.wait_open.call()
    gates.open.call().get()
    print(name, sorted(waiting.get().values()))
    print(name, sorted(gates.doubled.call(21).get().values()))
    try:
        gates.fail.call().get()
        print("no error")
    except ActorError as exc:
        print(name, "failure raised ActorError:", "a concurrent call failed" in str(exc))
    print(name, sorted(gates.wait_open.call().get().values()))
procs.stop().get()
