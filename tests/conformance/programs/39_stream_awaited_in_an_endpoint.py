"""An async endpoint awaits each reply of another actor mesh's stream() (passed in as an argument) without
holding its event loop; the replies are one per rank."""
from monarch.actor import Actor, current_rank, endpoint, this_host


class To(Actor):
    @endpoint
    async def whoami(self) -> int:
        return current_rank()["gpus"]


class From(Actor):
    @endpoint
    async def fetch(self, to: To) -> list[int]:
        return sorted([await reply for reply in to.whoami.stream()])


procs = this_host().spawn_procs(per_host={"gpus": 2})
to = procs.spawn("to", To)
to.whoami.call().get()
fetcher = procs.spawn("from", From)
print(sorted(tuple(got) for got in fetcher.fetch.call(to).get().values()))
print(sorted(reply.get() for reply in to.whoami.stream()))
procs.stop().get()
