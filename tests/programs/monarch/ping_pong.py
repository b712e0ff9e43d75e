"""Two actor meshes that call each other: sync endpoints wait on the other mesh's actors."""

from monarch.actor import Actor, ActorMesh, current_rank, endpoint, this_host


class Ponger(Actor):
    def __init__(self):
        self.hits = 0

    @endpoint
    def pong(self, ball: int) -> int:
        self.hits += 1
        return ball + 1

    @endpoint
    def count(self) -> int:
        return self.hits


class Pinger(Actor):
    def __init__(self, pongers: ActorMesh):
        self.pongers = pongers

    @endpoint
    def rally(self, rounds: int) -> int:
        me = current_rank()["gpus"]
        ball = 0
        for _ in range(rounds):  # a plain endpoint blocking on another actor of its own process: fine
            ball = self.pongers.slice(gpus=me).pong.call_one(ball).get()
        return ball


procs = this_host().spawn_procs(per_host={"gpus": 2})
pongers = procs.spawn("pongers", Ponger)
pingers = procs.spawn("pingers", Pinger, pongers)
assert list(pingers.rally.call(50).get().values()) == [50, 50]
assert list(pongers.count.call().get().values()) == [50, 50]
procs.stop().get()
print("OK")
