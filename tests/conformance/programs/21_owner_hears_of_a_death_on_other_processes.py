"""An actor spawns workers on processes of another proc mesh; when a worker's process dies, the
owner's __supervise__ hears of it, and the program goes on."""
import os
import time

import monarch.actor
from monarch.actor import Actor, endpoint, this_host

monarch.actor.unhandled_fault_hook = lambda failure: None  # (Monarch's own per-process actors die too)


class Worker(Actor):
    @endpoint
    def die(self) -> None:
        os._exit(7)

    @endpoint
    def ok(self) -> str:
        return "ok"


class Manager(Actor):
    def __init__(self, procs):
        self.failures = []
        self.workers = procs.spawn("workers", Worker)

    def __supervise__(self, failure) -> bool:
        self.failures.append("workers" in str(failure))
        return True

    @endpoint
    def kill_one(self) -> None:
        self.workers.slice(gpus=1).die.broadcast()

    @endpoint
    def heard(self) -> list:
        return self.failures


worker_procs = this_host().spawn_procs(per_host={"gpus": 2})
manager_procs = this_host().spawn_procs(per_host={"gpus": 1})
manager = manager_procs.spawn("manager", Manager, worker_procs)
manager.kill_one.call_one().get()
deadline = time.monotonic() + 30
while time.monotonic() < deadline and not manager.heard.call_one().get():
    time.sleep(0.1)
print(manager.heard.call_one().get()[:1])
