"""Extents as Monarch has them: a mapping with labels, sizes and nelements, printed as {hosts: 2, gpus: 3}, on proc,
actor and value meshes, slices of them and an actor's own point; Extent made by hand compares by labels and sizes."""
from monarch.actor import Actor, Extent, current_rank, endpoint, this_host


def described(extent) -> str:
    return (f"{extent} labels={list(extent.labels)} sizes={list(extent.sizes)} n={extent.nelements} "
            f"items={dict(extent)} len={len(extent)} keys={list(extent)}")


class Where(Actor):
    @endpoint
    def own_extent(self) -> str:
        return described(current_rank().extent)


procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 3})
print("procs", described(procs.extent))
print("a slice", described(procs.slice(gpus=slice(0, 2)).extent))
print("one host", described(procs.slice(hosts=1).extent))
actors = procs.spawn("where", Where)
print("actors", described(actors.extent))
values = actors.own_extent.call().get()
print("values", described(values.extent))
print("in an actor", values.item(hosts=1, gpus=2))
print("in a sliced actor", actors.slice(hosts=0, gpus=1).own_extent.call_one().get())
made = Extent(["a", "b"], [2, 3])
print("made", described(made), made == Extent(["a", "b"], [2, 3]), made == Extent(["a", "b"], [2, 4]),
      made["b"])
