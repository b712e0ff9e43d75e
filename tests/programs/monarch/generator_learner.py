"""A learner hands its port to generators, which send it samples; answers through explicit ports."""

from monarch.actor import Actor, Channel, Port, PortReceiver, ProcMesh, current_rank, endpoint, send, this_host


class Generator(Actor):
    def __init__(self):
        self.weights = 0

    @endpoint
    def generate(self, port: Port, steps: int) -> None:
        for step in range(steps):
            port.send({"from": current_rank()["gpus"], "step": step, "weights": self.weights})

    @endpoint
    def update(self, weights: int) -> None:
        self.weights = weights

    @endpoint(explicit_response_port=True)
    def version(self, port: Port) -> None:
        port.send(self.weights)  # answers through its port instead of returning


class Learner(Actor):
    def __init__(self, generator_procs: ProcMesh):
        self.generators = generator_procs.spawn("generators", Generator)
        self.waiting: Port | None = None

    @endpoint
    def learn(self, rounds: int, steps: int) -> list[tuple[int, int, int]]:
        seen = []
        for weights in range(rounds):
            port, receiver = Channel.open()
            receiver_: PortReceiver = receiver
            self.generators.generate.broadcast(port, steps)
            for _ in range(steps * self.generators.size()):
                sample = receiver_.recv().get(timeout=30)
                seen.append((sample["from"], sample["step"], sample["weights"]))
            self.generators.update.call(weights + 1).get()
        return sorted(seen)

    @endpoint
    def versions(self) -> list[int]:
        return list(self.generators.version.call().get().values())

    @endpoint(explicit_response_port=True)
    def when_told(self, port: Port) -> None:
        self.waiting = port  # answered later, by another endpoint

    @endpoint
    def tell(self, value: str) -> None:
        assert self.waiting is not None
        self.waiting.send(value)


procs = this_host().spawn_procs(per_host={"gpus": 3})
learner = procs.slice(gpus=0).spawn("learner", Learner, procs.slice(gpus=slice(1, 3)))
seen = learner.learn.call_one(2, 3).get()
assert seen == sorted((g, s, w) for g in (0, 1) for s in range(3) for w in (0, 1)), seen
assert learner.versions.call_one().get() == [2, 2]

pending = learner.when_told.call_one()
learner.tell.call_one("later").get()
assert pending.get(timeout=30) == "later"

port, receiver = Channel.open()  # the client's own port: `send` aims every answer at it
generators = procs.slice(gpus=slice(1, 3)).spawn("more_generators", Generator)
send(generators.version, (), {}, port=port)
assert sorted(receiver.recv().get(timeout=30) for _ in range(2)) == [0, 0]
ranked_port, ranked = Channel.open_ranked()
generators.generate.broadcast(ranked_port, 1)
assert sorted(rank for rank, _ in (ranked.recv().get(timeout=30) for _ in range(2))) == [1, 2]
procs.stop().get()
print("OK")
