"""A port passed to actors of another proc mesh, used many times."""
from monarch.actor import Actor, Channel, current_rank, endpoint, this_host


class Reporter(Actor):
    def __init__(self, port):
        self.port = port

    @endpoint
    def report(self, round_: int) -> None:
        self.port.send(f"round {round_} from {current_rank().rank}")


port, receiver = Channel.open()
procs_a = this_host().spawn_procs(per_host={"gpus": 2})
procs_b = this_host().spawn_procs(per_host={"gpus": 2})
ra = procs_a.spawn("ra", Reporter, port)
rb = procs_b.spawn("rb", Reporter, port)
for r in range(2):
    ra.report.call(r).get()
    rb.report.call(r).get()
print(sorted(receiver.recv().get() for _ in range(8)))
