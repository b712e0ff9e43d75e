"""An async actor's __supervise__ runs while one of its endpoints waits for it."""
import asyncio
import os

from monarch.actor import Actor, MeshFailure, endpoint, this_host


class Fragile(Actor):
    @endpoint
    async def die(self) -> None:
        os._exit(7)


class Watcher(Actor):
    def __init__(self) -> None:
        self.heard: list[bool] = []
        self.failed = asyncio.Event()

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.heard.append(isinstance(failure, MeshFailure))
        self.failed.set()
        return True

    @endpoint
    async def start(self) -> None:
        self.procs = this_host().spawn_procs(per_host={"gpus": 1})
        self.child = self.procs.spawn("fragile", Fragile)

    @endpoint
    async def kill_child_and_wait(self) -> list[bool]:
        self.child.die.broadcast()
        await asyncio.wait_for(self.failed.wait(), timeout=30)
        return self.heard[:1]


procs = this_host().spawn_procs(per_host={"gpus": 1})
watcher = procs.spawn("watcher", Watcher)
watcher.start.call_one().get()
print("heard while waiting:", watcher.kill_child_and_wait.call_one().get())
procs.stop().get()
