"""A manager actor owns worker actors on other processes and handles their failure."""

import os
import time

import monarch.actor as monarch_actor
from monarch.actor import Actor, MeshFailure, ProcMesh, endpoint, this_host


class Worker(Actor):
    @endpoint
    def work(self, x: int) -> int:
        return x * 2

    @endpoint
    def crash(self) -> None:
        os._exit(3)  # the process dies: a failure for the owner, not an exception for a caller


class Manager(Actor):
    def __init__(self, worker_procs: ProcMesh):
        self.workers = worker_procs.spawn("workers", Worker)  # owned by this actor
        self.failures: list[str] = []

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.failures.append(failure.report())
        return True  # handled: it goes no further

    @endpoint
    def run(self) -> list[int]:
        return list(self.workers.work.call(21).get().values())

    @endpoint
    def crash_one(self) -> None:
        self.workers.slice(gpus=1).crash.broadcast()

    @endpoint
    def seen(self) -> list[str]:
        return self.failures


class Careless(Actor):
    """Owns workers but handles nothing: their failure goes up to the program's hook."""

    def __init__(self, worker_procs: ProcMesh):
        self.workers = worker_procs.spawn("careless_workers", Worker)

    @endpoint
    def crash_one(self) -> None:
        self.workers.crash.broadcast()


unhandled: list[MeshFailure] = []
monarch_actor.unhandled_fault_hook = unhandled.append  # the client's hook, as in Monarch

procs = this_host().spawn_procs(per_host={"gpus": 4})
manager = procs.slice(gpus=0).spawn("manager", Manager, procs.slice(gpus=slice(1, 4)))
assert manager.run.call_one().get() == [42, 42, 42]
manager.crash_one.call_one().get()

deadline = time.monotonic() + 20
while not manager.seen.call_one().get() and time.monotonic() < deadline:
    time.sleep(0.05)
seen = manager.seen.call_one().get()
assert len(seen) == 1 and "<__main__.Manager manager>.<__main__.Worker workers{'gpus': 1/3}>" in seen[0], seen
assert not unhandled, [f.report() for f in unhandled]

careless_procs = this_host().spawn_procs(per_host={"gpus": 2})
careless = careless_procs.slice(gpus=1).spawn("careless", Careless, careless_procs.slice(gpus=slice(0, 1)))
careless.crash_one.call_one().get()
deadline = time.monotonic() + 20
while not unhandled and time.monotonic() < deadline:
    time.sleep(0.05)
assert len(unhandled) == 1, unhandled
report = unhandled[0].report()
assert "Worker careless_workers{'gpus': 0/1}> and all its descendants have failed" in report, report
assert "not handled by: actor mesh 'careless' on rank 1" in report, report
print(report)
careless_procs.stop().get()
procs.stop().get()
print("OK")
