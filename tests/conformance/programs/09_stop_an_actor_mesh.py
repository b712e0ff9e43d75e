"""After stop(), an actor mesh takes no more calls; its processes still serve other actors."""
import monarch.actor
from monarch.actor import Actor, endpoint, this_host


class Alive(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"


faults = []
monarch.actor.unhandled_fault_hook = faults.append  # the program goes on; what reached the client is counted

procs = this_host().spawn_procs(per_host={"gpus": 2})
first = procs.spawn("first", Alive)
second = procs.spawn("second", Alive)
print(sorted(first.ping.call().get().values()))
first.stop().get()
try:
    first.ping.call().get()
    print("called a stopped mesh")
except Exception as exc:
    print("stopped mesh raised", type(exc).__name__)
print(sorted(second.ping.call().get().values()))
procs.stop().get()
