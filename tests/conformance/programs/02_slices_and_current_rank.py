"""current_rank() and current_size() are relative to the mesh or slice a message was sent through."""
from monarch.actor import Actor, current_rank, current_size, endpoint, this_host


class Where(Actor):
    @endpoint
    def who(self) -> tuple:
        return (dict(current_rank()), current_rank().rank, dict(current_size()))


procs = this_host().spawn_procs(per_host={"gpus": 4})
where = procs.spawn("where", Where)
for label, handle in [("all", where), ("gpus 1:3", where.slice(gpus=slice(1, 3))), ("gpus 2:4", where.slice(gpus=slice(2, 4)))]:
    answers = handle.who.call().get()
    for point, value in sorted(answers.items(), key=lambda kv: kv[1][1]):
        print(label, dict(point), value)
print("one", where.slice(gpus=3).who.call_one().get())
procs.stop().get()
