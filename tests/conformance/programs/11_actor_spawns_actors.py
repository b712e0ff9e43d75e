"""An actor spawns actors of its own on a proc mesh handed to it, and calls them."""
from monarch.actor import Actor, current_rank, endpoint, this_host


class Leaf(Actor):
    def __init__(self, tag: str):
        self.tag = tag

    @endpoint
    def hello(self) -> str:
        return f"{self.tag}:{current_rank().rank}"


class Manager(Actor):
    def __init__(self, procs):
        self.leaves = procs.spawn("leaves", Leaf, "leaf")

    @endpoint
    def gather(self) -> list:
        return sorted(self.leaves.hello.call().get().values())


procs = this_host().spawn_procs(per_host={"gpus": 3})
manager_procs = this_host().spawn_procs(per_host={"gpus": 1})
manager = manager_procs.spawn("manager", Manager, procs)
print(manager.gather.call_one().get())
