"""shutdown_context() ends what the program started; calling it again is harmless."""
from monarch.actor import Actor, endpoint, shutdown_context, this_host


class Echo(Actor):
    @endpoint
    def echo(self, text: str) -> str:
        return text


procs = this_host().spawn_procs(per_host={"gpus": 2})
print(sorted(procs.spawn("echo", Echo).echo.call("hi").get().values()))
print(shutdown_context().get())
print(shutdown_context().get())
