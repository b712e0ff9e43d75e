"""What a failure says: the actor by its full name and point, in Monarch's words, in the error and the report."""
import os
import re
import threading

import monarch.actor
from monarch.actor import Actor, MeshFailure, endpoint, this_host


class Doomed(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def exit_now(self) -> None:
        os._exit(5)


faults: list[MeshFailure] = []
arrived = threading.Event()


def hook(failure: MeshFailure) -> None:
    faults.append(failure)
    if "doomed" in str(failure):  # (Monarch may also report its own per-process actors)
        arrived.set()


monarch.actor.unhandled_fault_hook = hook
procs = this_host().spawn_procs(per_host={"gpus": 2})
doomed = procs.spawn("doomed", Doomed)
doomed.pid.call().get()
try:
    doomed.slice(gpus=1).exit_now.call_one().get()
    print("the call answered")
except Exception as exc:
    text = str(exc)
    print(type(exc).__name__)
    print("names the actor:", "<root>.<__main__.Doomed doomed{'gpus': 1/2}> and all its descendants have failed" in text)
print("hook called:", arrived.wait(timeout=30))
failure = next(f for f in faults if "doomed" in str(f))
print("report:", failure.report().splitlines()[0])
print("str names the rank:", "crashed_ranks=[1]" in str(failure),
      bool(re.search(r"Supervision event: actor <root>\.<__main__\.Doomed doomed\{'gpus': 1/2\}> failed", str(failure))))
