"""get_or_spawn_controller gives the one actor of a name, to the client and to actors alike."""
from monarch.actor import Actor, endpoint, get_or_spawn_controller, this_host


class Tally(Actor):
    def __init__(self, start: int) -> None:
        self.count = start

    @endpoint
    def add(self) -> int:
        self.count += 1
        return self.count


class Worker(Actor):
    @endpoint
    def report(self) -> int:
        return get_or_spawn_controller("tally", Tally, 0).get().add.call_one().get()


tally = get_or_spawn_controller("tally", Tally, 100).get()
print(tally.add.call_one().get())
print(get_or_spawn_controller("tally", Tally, 500).get().add.call_one().get())
procs = this_host().spawn_procs(per_host={"gpus": 2})
workers = procs.spawn("workers", Worker)
print(sorted(workers.report.call().get().values()))
print(tally.add.call_one().get())
other = get_or_spawn_controller("other", Tally, 0).get()
print(other.add.call_one().get())
procs.stop().get()
