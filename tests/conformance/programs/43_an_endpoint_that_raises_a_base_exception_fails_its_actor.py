"""An endpoint that raises a BaseException (not an Exception) fails its actor: the call raises SupervisionError,
the owner's __supervise__ hears of it, the other ranks' actors serve on; an application error leaves the actor
as it was."""
import sys

from monarch.actor import Actor, MeshFailure, endpoint, this_host


class Fatal(BaseException):
    pass


class Fragile(Actor):
    @endpoint
    async def fail(self) -> None:
        raise Fatal("simulated failure")

    @endpoint
    async def app_error(self) -> None:
        raise RuntimeError("an application error")

    @endpoint
    async def check(self) -> str:
        return "ok"


class Owner(Actor):
    def __init__(self, procs) -> None:
        self.children = procs.spawn("children", Fragile)
        self.heard: list[int] = []

    @endpoint
    async def fail_one(self) -> str:
        try:
            await self.children.slice(gpus=1).fail.call_one()
        except Exception as exc:  # (Monarch 0.7.0 does not export SupervisionError from monarch.actor)
            return f"the call raised {type(exc).__name__}"
        return "the call did not raise"

    @endpoint
    async def heard_of(self) -> int:
        return len(self.heard)

    @endpoint
    async def check_child(self) -> str:
        return await self.children.slice(gpus=0).check.call_one()

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.heard.append(1)
        return True


procs = this_host().spawn_procs(per_host={"gpus": 2})
fragile = procs.spawn("fragile", Fragile)
try:
    fragile.slice(gpus=0).app_error.call_one().get()
except Exception as exc:
    print("an application error:", type(exc).__name__)
print("after it:", fragile.slice(gpus=0).check.call_one().get())

children_procs = this_host().spawn_procs(per_host={"gpus": 2})
owner = procs.slice(gpus=0).spawn("owner", Owner, children_procs)
print(owner.fail_one.call_one().get())
print("the owner heard of", owner.heard_of.call_one().get(), "failure(s)")
print("its other child:", owner.check_child.call_one().get())
children_procs.stop().get()
procs.stop().get()
sys.stdout.flush()
