"""The getting-started counter: broadcast, call, call_one, and a ValueMesh of the answers."""
from monarch.actor import Actor, endpoint, this_host


class Counter(Actor):
    def __init__(self, start: int):
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> None:
        self.value += by

    @endpoint
    def get(self) -> int:
        return self.value


procs = this_host().spawn_procs(per_host={"gpus": 4})
counters = procs.spawn("counters", Counter, 10)
counters.incr.broadcast()
counters.incr.call(by=5).get()
values = counters.get.call().get()
print(sorted(values.values()))
print(counters.slice(gpus=2).get.call_one().get())
counters.slice(gpus=slice(0, 2)).incr.call().get()
print([v for _, v in sorted(counters.get.call().get().items(), key=lambda kv: kv[0]["gpus"])])
procs.stop().get()
