"""A class that mixes sync and async endpoints cannot be spawned; the processes serve on."""
from monarch.actor import Actor, endpoint, this_host


class Mixed(Actor):
    @endpoint
    def plain(self) -> int:
        return 1

    @endpoint
    async def waiting(self) -> int:
        return 2


class SyncWithAsyncCleanup(Actor):
    @endpoint
    def plain(self) -> int:
        return 1

    async def __cleanup__(self, exc: Exception | None) -> None:
        pass


class Fine(Actor):
    @endpoint
    def plain(self) -> int:
        return 3


procs = this_host().spawn_procs(per_host={"gpus": 2})
for cls in (Mixed, SyncWithAsyncCleanup):
    try:
        procs.spawn(cls.__name__.lower(), cls).initialized.get()
        print(cls.__name__, "spawned")
    except ValueError:
        print(cls.__name__, "refused with ValueError")
print(sorted(procs.spawn("fine", Fine).plain.call().get().values()))
procs.stop().get()
