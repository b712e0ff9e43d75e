"""A broadcast from an actor that fails on its target reaches the sender's __supervise__."""
import time

from monarch.actor import Actor, endpoint, this_host


class Bad(Actor):
    @endpoint
    def explode(self) -> None:
        raise RuntimeError("boom")


class Boss(Actor):
    def __init__(self, procs):
        self.seen = []
        self.bad = procs.spawn("bad", Bad)

    def __supervise__(self, failure) -> bool:
        self.seen.append("boom" in str(failure))
        return True

    @endpoint
    def fire(self) -> None:
        self.bad.explode.broadcast()

    @endpoint
    def seen_failures(self) -> list:
        return self.seen


procs = this_host().spawn_procs(per_host={"gpus": 1})
boss_procs = this_host().spawn_procs(per_host={"gpus": 1})
boss = boss_procs.spawn("boss", Boss, procs)
boss.fire.call_one().get()
deadline = time.monotonic() + 20
while time.monotonic() < deadline and not boss.seen_failures.call_one().get():
    time.sleep(0.2)
print(boss.seen_failures.call_one().get())
