"""A ValueMesh: items(), values(), item(), and its points."""
from monarch.actor import Actor, current_rank, endpoint, this_host


class Square(Actor):
    @endpoint
    def square(self) -> int:
        return current_rank().rank ** 2


procs = this_host().spawn_procs(per_host={"gpus": 4})
squares = procs.spawn("squares", Square).square.call().get()
print(sorted(squares.values()))
print(sorted(((dict(p), v) for p, v in squares.items()), key=lambda pv: pv[1]))
print(squares.item(gpus=3))
print(len(list(squares.values())))
procs.stop().get()
