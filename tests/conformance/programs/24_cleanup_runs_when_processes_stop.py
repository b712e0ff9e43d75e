"""Stopping a proc mesh cancels its actors' running concurrent calls, then runs each actor's __cleanup__."""
import asyncio
import os
import sys
import tempfile

from monarch.actor import Actor, concurrent_endpoint, current_rank, this_host


class Journal(Actor):
    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, f"rank{current_rank().rank}.txt")
        self.started = asyncio.Event()

    def write(self, line: str) -> None:
        with open(self.path, "a") as out:
            out.write(line + "\n")

    @concurrent_endpoint
    async def forever(self) -> None:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.write("the running call was cancelled")
            raise

    @concurrent_endpoint
    async def ready(self) -> None:
        await self.started.wait()

    async def __cleanup__(self, exc: Exception | None) -> None:
        self.write(f"cleanup ran, exception: {exc}")


folder = tempfile.mkdtemp()
procs = this_host().spawn_procs(per_host={"gpus": 2})
journals = procs.spawn("journals", Journal, folder)
running = journals.forever.call()
journals.ready.call().get()
procs.stop().get()
for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name)) as lines:
        print(name, [line.strip() for line in lines])
sys.stdout.flush()
os._exit(0)  # (the stopped call's future is not waited for)
