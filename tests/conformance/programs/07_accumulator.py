"""Accumulator folds the answers of every actor into one value."""
from monarch.actor import Accumulator, Actor, current_rank, endpoint, this_host


class Worker(Actor):
    @endpoint
    def work(self, scale: int) -> int:
        return scale * (current_rank().rank + 1)


procs = this_host().spawn_procs(per_host={"gpus": 4})
workers = procs.spawn("workers", Worker)
print(Accumulator(workers.work, 0, lambda total, x: total + x).accumulate(10).get())
print(Accumulator(workers.work, [], lambda seen, x: sorted(seen + [x])).accumulate(1).get())
procs.stop().get()
