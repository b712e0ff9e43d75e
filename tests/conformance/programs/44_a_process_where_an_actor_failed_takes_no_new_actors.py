"""After an actor fails on a process, a spawn there fails ("error spawning actor mesh"), also later: the other
actors of that process serve on, and processes where nothing failed take new actors."""
import threading

import monarch.actor
from monarch.actor import Actor, endpoint, this_host


class Fatal(BaseException):
    pass


class Fragile(Actor):
    @endpoint
    async def fail(self) -> None:
        raise Fatal("simulated failure")

    @endpoint
    async def check(self) -> str:
        return "ok"


heard = threading.Event()
monarch.actor.unhandled_fault_hook = lambda failure: heard.set()
procs = this_host().spawn_procs(per_host={"gpus": 2})
fragile = procs.spawn("fragile", Fragile)
bystander = procs.spawn("bystander", Fragile)
try:
    fragile.slice(gpus=1).fail.call_one().get()
except Exception as exc:  # (Monarch 0.7.0 does not export SupervisionError from monarch.actor)
    print("the failing call raised", type(exc).__name__)
print("the fault hook heard of it:", heard.wait(timeout=30))
for attempt in ("a spawn on both processes", "again"):
    try:
        procs.spawn("late", Fragile).initialized.get()
        print(attempt, "worked")
    except RuntimeError as exc:
        print(attempt, "raised:", "error spawning actor mesh" in str(exc))
print("the process where nothing failed:", procs.slice(gpus=0).spawn("late0", Fragile).check.call_one().get())
print("the other actor where one failed:", bystander.slice(gpus=1).check.call_one().get())
procs.stop().get()
