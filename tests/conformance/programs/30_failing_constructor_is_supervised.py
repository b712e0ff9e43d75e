"""A constructor that raises fails its actor, not the spawn: the fault hook hears of each rank, and calls
say why."""
import threading

import monarch.actor
from monarch.actor import Actor, MeshFailure, endpoint, this_host


class Fragile(Actor):
    def __init__(self, fail: bool) -> None:
        if fail:
            raise ValueError("no config for this rank")

    @endpoint
    def ping(self) -> str:
        return "pong"


faults: list[MeshFailure] = []
every_rank = threading.Event()


def hook(failure: MeshFailure) -> None:
    faults.append(failure)
    if len(faults) == 2:
        every_rank.set()


monarch.actor.unhandled_fault_hook = hook
procs = this_host().spawn_procs(per_host={"gpus": 2})
fragile = procs.spawn("fragile", Fragile, True)
print("spawn returned")
print("both ranks reported:", every_rank.wait(timeout=30))
print(sorted(("fragile" in str(f), "no config for this rank" in str(f)) for f in faults))
try:
    fragile.ping.call().get()
    print("the call answered")
except Exception as exc:
    print("call raised", type(exc).__name__, "no config for this rank" in str(exc))
procs.stop().get()
