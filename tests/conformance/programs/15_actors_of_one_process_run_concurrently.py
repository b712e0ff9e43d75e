"""Two actor meshes on the same processes serve their calls at the same time."""
import asyncio
import time

from monarch.actor import Actor, endpoint, this_host


class Sleeper(Actor):
    @endpoint
    async def nap(self, seconds: float) -> float:
        start = time.monotonic()
        await asyncio.sleep(seconds)
        return start


procs = this_host().spawn_procs(per_host={"gpus": 2})
a = procs.spawn("a", Sleeper)
b = procs.spawn("b", Sleeper)
a.nap.call(0.1).get()
b.nap.call(0.1).get()
start = time.monotonic()
fa, fb = a.nap.call(1.0), b.nap.call(1.0)
fa.get(), fb.get()
elapsed = time.monotonic() - start
print("concurrent" if elapsed < 1.8 else f"serial ({elapsed:.1f}s)")
procs.stop().get()
