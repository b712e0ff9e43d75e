"""An endpoint that raises fails its call with ActorError; the actor lives on."""
from monarch.actor import Actor, ActorError, current_rank, endpoint, this_host


class Picky(Actor):
    @endpoint
    def check(self, x: int) -> int:
        if current_rank().rank == 1 and x < 0:
            raise ValueError(f"negative input {x}")
        return x * 2


procs = this_host().spawn_procs(per_host={"gpus": 2})
picky = procs.spawn("picky", Picky)
print(sorted(picky.check.call(3).get().values()))
try:
    picky.check.call(-1).get()
except ActorError as exc:
    print("ActorError:", isinstance(exc, Exception), "negative input -1" in str(exc))
print(sorted(picky.check.call(4).get().values()))
try:
    picky.slice(gpus=1).check.call_one(-7).get()
except ActorError as exc:
    print("ActorError:", "negative input -7" in str(exc), "ValueError" in str(exc))
procs.stop().get()
