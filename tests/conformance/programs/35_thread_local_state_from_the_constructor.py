"""Thread-local state an actor's __init__ sets is there in its endpoints: async ones (which run on the
actor's event loop) and sync ones alike."""
import threading

from monarch.actor import Actor, endpoint, this_host


class AsyncCounter(Actor):
    def __init__(self) -> None:
        self.local = threading.local()
        self.local.value = 0

    @endpoint
    async def increment(self) -> None:
        self.local.value += 1

    @endpoint
    async def value(self) -> int:
        return self.local.value


class SyncCounter(Actor):
    def __init__(self) -> None:
        self.local = threading.local()
        self.local.value = 10

    @endpoint
    def increment(self) -> None:
        self.local.value += 1

    @endpoint
    def value(self) -> int:
        return self.local.value


procs = this_host().spawn_procs(per_host={"gpus": 1})
for cls in (AsyncCounter, SyncCounter):
    counter = procs.spawn(cls.__name__.lower(), cls)
    for _ in range(3):
        counter.increment.call_one().get()
    print(cls.__name__, "counted", counter.value.call_one().get())
procs.stop().get()
