"""After a proc mesh is stopped, its actors cannot be called and nothing can be spawned on it."""
import monarch.actor
from monarch.actor import Actor, endpoint, this_host


class Alive(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"


faults = []
monarch.actor.unhandled_fault_hook = faults.append  # the program goes on

procs = this_host().spawn_procs(per_host={"gpus": 2})
alive = procs.spawn("alive", Alive)
print(sorted(alive.ping.call().get().values()))
procs.stop().get()
try:
    alive.ping.call().get(timeout=30)
    print("called actors of a stopped proc mesh")
except Exception as exc:
    print("call raised", type(exc).__name__)
try:
    procs.spawn("again", Alive)
    print("spawned on a stopped proc mesh")
except Exception as exc:
    print("spawn raised a RuntimeError:", isinstance(exc, RuntimeError))
