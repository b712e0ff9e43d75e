"""context() tells which actor runs the code, who spawned it, and where the message was sent."""
from monarch.actor import Actor, context, current_actor_name, current_rank, endpoint, this_host, this_proc


class Child(Actor):
    @endpoint
    def who(self) -> str:
        instance = context().actor_instance
        return f"{instance} created by {instance.creator}"


class Named(Actor):
    def __init__(self) -> None:
        self.made_in = str(context().actor_instance)

    @endpoint
    def who(self) -> str:
        instance = context().actor_instance
        return f"{instance} rank {current_rank()} made in constructor: {self.made_in == str(instance)}"

    @endpoint
    def actor_name(self) -> str:
        return current_actor_name()

    @endpoint
    def creator(self) -> str:
        return f"{context().actor_instance.creator.name}"

    @endpoint
    def child_says(self) -> str:
        child = this_proc().spawn("child", Child)
        return child.who.call_one().get()


print(context().actor_instance, context().actor_instance.creator)
procs = this_host().spawn_procs(per_host={"gpus": 2})
named = procs.spawn("named", Named)
for point, text in named.who.call().get().items():
    print(point, text)
names = list(named.actor_name.call().get().values())
print("actor names distinct:", len(set(names)) == 2, "differ from the client's:", current_actor_name() not in names)
print(sorted(named.creator.call().get().values()))
print(named.slice(gpus=1).child_says.call_one().get())
procs.stop().get()
