"""Folding the answers of a mesh with an Accumulator."""

import operator

from monarch.actor import Accumulator, Actor, current_rank, endpoint, this_host


class Shard(Actor):
    def __init__(self, base: int):
        self.rows = [base + current_rank()["gpus"] * 10 + i for i in range(3)]

    @endpoint
    def total(self) -> int:
        return sum(self.rows)

    @endpoint
    def rows_of(self) -> list[int]:
        return self.rows


procs = this_host().spawn_procs(per_host={"gpus": 4})
shards = procs.spawn("shards", Shard, 100)
total = Accumulator(shards.total, 0, operator.add).accumulate().get()
assert total == sum(100 + g * 10 + i for g in range(4) for i in range(3)), total
rows = Accumulator(shards.rows_of, [], lambda acc, rows: sorted(acc + rows)).accumulate().get()
assert len(rows) == 12 and rows == sorted(rows)
assert Accumulator(shards.slice(gpus=slice(0, 2)).total, 0, max).accumulate().get() == 110 + 111 + 112
procs.stop().get()
print("OK")
