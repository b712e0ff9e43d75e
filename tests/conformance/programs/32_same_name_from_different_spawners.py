"""Actor meshes of one name spawned by different actors are separate meshes; the client's respawn replaces."""
from monarch.actor import Actor, ProcMesh, current_rank, endpoint, this_host


class Kid(Actor):
    def __init__(self, parent: int) -> None:
        self.parent = parent

    @endpoint
    def parent_rank(self) -> int:
        return self.parent


class Parent(Actor):
    def __init__(self, procs: ProcMesh) -> None:
        self.kids = procs.spawn("kid", Kid, current_rank().rank)

    @endpoint
    def kids_say(self) -> list[int]:
        return sorted(self.kids.parent_rank.call().get().values())


kid_procs = this_host().spawn_procs(per_host={"gpus": 2})
parent_procs = this_host().spawn_procs(per_host={"gpus": 2})
parents = parent_procs.spawn("parents", Parent, kid_procs)
for point, kids in sorted(parents.kids_say.call().get().items(), key=lambda item: item[0].rank):
    print(point.rank, kids)
first = kid_procs.spawn("mine", Kid, 100)
second = kid_procs.spawn("mine", Kid, 200)
print(sorted(second.parent_rank.call().get().values()))
for point, kids in sorted(parents.kids_say.call().get().items(), key=lambda item: item[0].rank):
    print(point.rank, kids)
parent_procs.stop().get()
kid_procs.stop().get()
