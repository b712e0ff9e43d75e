"""An endpoint with explicit_response_port answers through the port it is given."""
from monarch.actor import Actor, current_rank, endpoint, this_host


class Later(Actor):
    @endpoint(explicit_response_port=True)
    def answer(self, port, x: int) -> None:
        port.send(x + current_rank().rank)


procs = this_host().spawn_procs(per_host={"gpus": 3})
later = procs.spawn("later", Later)
print(sorted(later.answer.call(10).get().values()))
print(later.slice(gpus=2).answer.call_one(1).get())
procs.stop().get()
