"""A process that dies in an endpoint fails the call; the error is not the endpoint's."""
import os
import time

import monarch.actor
from monarch.actor import Actor, ActorError, endpoint, this_host


class Fragile(Actor):
    @endpoint
    def crash(self) -> None:
        os._exit(3)


faults = []
monarch.actor.unhandled_fault_hook = faults.append  # the program goes on; what reached the client is counted

procs = this_host().spawn_procs(per_host={"gpus": 1})
fragile = procs.spawn("fragile", Fragile)
try:
    fragile.crash.call_one().get(timeout=60)
    print("no error")
except ActorError as exc:
    print("ActorError subclass:", type(exc).__name__)
except Exception as exc:
    print("other error:", type(exc).__name__, isinstance(exc, ActorError))
deadline = time.monotonic() + 30  # the fault reaches the hook on its own time
while not faults and time.monotonic() < deadline:
    time.sleep(0.05)
print("faults reached the client:", bool(faults))
