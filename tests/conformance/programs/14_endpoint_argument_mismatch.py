"""Calling an endpoint with arguments it cannot take fails in the caller, before anything is sent."""
from monarch.actor import Actor, endpoint, this_host


class Adder(Actor):
    def __init__(self):
        self.calls = 0

    @endpoint
    def add(self, a: int, b: int) -> int:
        self.calls += 1
        return a + b

    @endpoint
    def count(self) -> int:
        return self.calls


procs = this_host().spawn_procs(per_host={"gpus": 2})
adder = procs.spawn("adder", Adder)
for args, kwargs in [((1,), {}), ((1, 2, 3), {}), ((1,), {"c": 2})]:
    try:
        adder.add.call(*args, **kwargs)
        print("sent", args, kwargs)
    except TypeError:
        print("TypeError before sending", args, kwargs)
print(sorted(adder.add.call(1, 2).get().values()))
print(sorted(adder.count.call().get().values()))
procs.stop().get()
