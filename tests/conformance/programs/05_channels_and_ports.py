"""A Channel opened in the client; actors send through its Port; the receiver reads them."""
from monarch.actor import Actor, Channel, current_rank, endpoint, this_host


class Producer(Actor):
    @endpoint
    def produce(self, port, n: int) -> None:
        for i in range(n):
            port.send((current_rank().rank, i))


procs = this_host().spawn_procs(per_host={"gpus": 3})
producers = procs.spawn("producers", Producer)
port, receiver = Channel.open()
producers.produce.call(port, 2).get()
got = sorted(receiver.recv().get() for _ in range(6))
print(got)
