"""Async endpoints await calls to other actors (sync ones on another actor mesh)."""
import asyncio

from monarch.actor import Actor, current_rank, endpoint, this_host


class Store(Actor):
    def __init__(self):
        self.data = {}

    @endpoint
    def put(self, key: str, value: int) -> None:
        self.data[key] = value

    @endpoint
    def get(self, key: str) -> int:
        return self.data[key]


class Client(Actor):
    def __init__(self, store):
        self.store = store

    @endpoint
    async def roundtrip(self, key: str) -> int:
        me = current_rank().rank
        await self.store.slice(gpus=me).put.call_one(key, 100 + me)
        values = await asyncio.gather(*(self.store.slice(gpus=me).get.call_one(key) for _ in range(3)))
        return sum(values)


procs = this_host().spawn_procs(per_host={"gpus": 2})
store = procs.spawn("store", Store)
clients = procs.spawn("clients", Client, store)
print(sorted(clients.roundtrip.call("k").get().values()))
procs.stop().get()
