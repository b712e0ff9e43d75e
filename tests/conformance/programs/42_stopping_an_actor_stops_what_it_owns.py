"""Stopping an actor mesh stops what its actors own: the actors they spawned (on processes passed to them and
on processes they started themselves, whose __cleanup__ runs) and the processes they started."""
import os
import sys
import tempfile
import time

from monarch.actor import Actor, endpoint, this_host


class Journal(Actor):
    def __init__(self, path: str) -> None:
        self.path = path

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    def __cleanup__(self, exc: Exception | None) -> None:
        with open(self.path, "w") as out:
            out.write(f"cleanup ran, exception: {exc}")


class Owner(Actor):
    def __init__(self, procs, folder: str) -> None:
        self.procs = this_host().spawn_procs()
        self.on_passed = procs.spawn("on_passed", Journal, os.path.join(folder, "on_passed.txt"))
        self.on_owned = self.procs.spawn("on_owned", Journal, os.path.join(folder, "on_owned.txt"))

    @endpoint
    def pids(self) -> list:
        return [self.on_passed.pid.call_one().get(), self.on_owned.pid.call_one().get()]


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


folder = tempfile.mkdtemp()
procs = this_host().spawn_procs(per_host={"gpus": 1})
owner = procs.spawn("owner", Owner, procs, folder)
passed_pid, owned_pid = owner.pids.call_one().get()
print("before the stop:", sorted(os.listdir(folder)))
owner.stop().get()
deadline = time.monotonic() + 60  # (the owned actors' clean-up may finish after stop() returns)
while (len(os.listdir(folder)) < 2 or running(owned_pid)) and time.monotonic() < deadline:
    time.sleep(0.1)
for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name)) as journal:
        print(name, journal.read())
print("the process the owner started is gone:", not running(owned_pid))
print("the process passed to the owner runs on:", running(passed_pid))
procs.stop().get()
sys.stdout.flush()
os._exit(0)
