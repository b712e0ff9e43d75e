"""An async endpoint awaits get_or_spawn_controller, which spawns the controller in the same process as the
endpoint's own actor (controllers all live there)."""
from monarch.actor import Actor, endpoint, get_or_spawn_controller


class Keeper(Actor):
    def __init__(self, root: str = "none") -> None:
        self.root = root

    @endpoint
    async def root_of(self) -> str:
        return self.root

    @endpoint
    async def make(self, name: str) -> str:
        made = await get_or_spawn_controller(name, Keeper, root=self.root + "/" + name)
        return await made.root_of.call_one()


first = get_or_spawn_controller("first", Keeper, root="first").get()
print(first.make.call_one("second").get())
print(get_or_spawn_controller("second", Keeper).get().root_of.call_one().get())
