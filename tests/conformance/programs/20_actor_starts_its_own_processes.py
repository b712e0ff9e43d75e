"""An actor starts processes itself (this_host() inside its constructor and an endpoint), spawns actors
there, calls them, and stops them."""
from monarch.actor import Actor, current_rank, endpoint, this_host


class Worker(Actor):
    @endpoint
    def square(self, x: int) -> int:
        return x * x + current_rank().rank


class Boss(Actor):
    def __init__(self):
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.workers = self.procs.spawn("workers", Worker)

    @endpoint
    def work(self, x: int) -> list:
        return sorted(self.workers.square.call(x).get().values())

    @endpoint
    def more(self) -> list:
        extra = this_host().spawn_procs(per_host={"gpus": 1})
        helpers = extra.spawn("helpers", Worker)
        answer = helpers.square.call_one(5).get()
        extra.stop().get()
        return [answer]


boss_procs = this_host().spawn_procs(per_host={"gpus": 1})
boss = boss_procs.spawn("boss", Boss)
print(boss.work.call_one(3).get())
print(boss.more.call_one().get())
