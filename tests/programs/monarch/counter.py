"""Counters on a host mesh: every adverb, value meshes, mesh slicing and the current rank."""

import asyncio

from monarch.actor import Actor, Future, ValueMesh, current_rank, current_size, endpoint, this_host, this_proc


class Counter(Actor):
    def __init__(self, start: int):
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> None:
        self.value += by

    @endpoint
    def get(self) -> int:
        return self.value

    @endpoint
    def where(self) -> tuple[dict, dict]:
        return dict(current_rank()), current_size()


procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2})
assert procs.extent == {"hosts": 2, "gpus": 2} and procs.size() == 4

counters = procs.spawn("counters", Counter, 10)
counters.incr.broadcast()                      # fire and forget, in order before what follows
counters.slice(hosts=1).incr.call(5).get()      # call: a ValueMesh of replies (here: Nones)

values = counters.get.call().get()
assert isinstance(values, ValueMesh)
assert list(values.values()) == [11, 11, 16, 16]
assert values.item(hosts=1, gpus=0) == 16
assert list(values.slice(hosts=0).values()) == [11, 11]
assert [p["gpus"] for p, _ in values.items()] == [0, 1, 0, 1]
assert list(values.flatten("rank").values()) == [11, 11, 16, 16]

one = counters.slice(hosts=1, gpus=1)
assert one.get.call_one().get() == 16
assert one.where.call_one().get() == ({}, {})  # in the slice it was sent through (as Monarch)
assert counters.where.call().get().item(hosts=1, gpus=0) == ({"hosts": 1, "gpus": 0}, {"hosts": 2, "gpus": 2})
assert counters.get.choose().get() in (11, 16)
assert sorted(f.get() for f in counters.get.stream()) == [11, 11, 16, 16]

# dims renamed, split, flattened, on processes and on actors alike
renamed = procs.rename(gpus="tp").spawn("renamed", Counter, 0)
assert renamed.where.call().get().item(hosts=0, tp=1)[0] == {"hosts": 0, "tp": 1}
assert list(counters.rename(gpus="tp").slice(tp=0).get.call().get().values()) == [11, 16]
flat = procs.flatten("rank")
assert flat.size("rank") == 4
flat_counters = flat.spawn("flat", Counter, 0)
assert flat_counters.where.call().get().item(rank=3) == ({"rank": 3}, {"rank": 4})
split = flat.split(rank=("dp", "tp"), tp=2)
assert split.extent == {"dp": 2, "tp": 2}
assert split.spawn("split", Counter, 0).where.call().get().item(dp=1, tp=0)[0] == {"dp": 1, "tp": 0}
assert counters.flatten("r").slice(r=slice(1, 3)).get.call().get().size() == 2


async def main() -> list[int]:  # futures can be awaited
    fut: Future = counters.get.call()
    return list((await fut).values())


assert asyncio.run(main()) == [11, 11, 16, 16]

local = this_proc().spawn("local", Counter, 7)  # an actor near the client
local.incr.call_one(3).get()
assert local.get.call_one().get() == 10

procs.stop().get()
print("OK")
