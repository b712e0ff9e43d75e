"""Sync and async actors of the same processes: which calls run at the same time, and blocking
calls from a sync endpoint to other actors of its own process."""
import asyncio
import time

from monarch.actor import Actor, current_rank, endpoint, this_host


class AsyncSleeper(Actor):
    @endpoint
    async def nap(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "async"


class SyncSleeper(Actor):
    @endpoint
    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "sync"


class Relay(Actor):
    """Calls another actor mesh on the same processes and blocks on the reply."""

    def __init__(self, other):
        self.other = other

    @endpoint
    def relay(self) -> str:
        mine = self.other.slice(gpus=current_rank()["gpus"])
        return mine.nap.call_one(0.2).get()


def timed(*futures) -> float:
    start = time.monotonic()
    for future in futures:
        future.get()
    return time.monotonic() - start


procs = this_host().spawn_procs(per_host={"gpus": 2})
quick = procs.spawn("quick", AsyncSleeper)
slow = procs.spawn("slow", SyncSleeper)
more = [procs.spawn(f"sync{i}", SyncSleeper) for i in range(3)]
quick.nap.call(0.1).get(), slow.nap.call(0.1).get()
for m in more:
    m.nap.call(0.1).get()

elapsed = timed(quick.nap.call(0.5), quick.nap.call(0.5))
print("one async actor:", "concurrent" if elapsed < 0.9 else "one call at a time")
elapsed = timed(quick.nap.call(1.0), slow.nap.call(1.0))
print("an async and a sync actor:", "concurrent" if elapsed < 1.8 else "one after the other")
elapsed = timed(slow.nap.call(1.0), *(m.nap.call(1.0) for m in more))
print("four sync actors:", "concurrent" if elapsed < 2.5 else "one after the other")

to_sync = procs.spawn("to_sync", Relay, slow)
to_async = procs.spawn("to_async", Relay, quick)
print("sync endpoint blocks on a sync actor of its process:", sorted(to_sync.relay.call().get().values()))
print("sync endpoint blocks on an async actor of its process:", sorted(to_async.relay.call().get().values()))
procs.stop().get()
