"""Sync endpoints of two actor meshes on the same processes: do they run at the same time?"""
import time

from monarch.actor import Actor, endpoint, this_host


class Sleeper(Actor):
    @endpoint
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)


procs = this_host().spawn_procs(per_host={"gpus": 2})
a = procs.spawn("a", Sleeper)
b = procs.spawn("b", Sleeper)
a.nap.call(0.1).get()
b.nap.call(0.1).get()
start = time.monotonic()
fa, fb = a.nap.call(1.0), b.nap.call(1.0)
fa.get(), fb.get()
elapsed = time.monotonic() - start
print("concurrent" if elapsed < 1.8 else "one after the other")
start = time.monotonic()
f1, f2 = a.nap.call(0.5), a.nap.call(0.5)
f1.get(), f2.get()
elapsed = time.monotonic() - start
print("one actor: concurrent" if elapsed < 0.9 else "one actor: one call at a time")
procs.stop().get()
