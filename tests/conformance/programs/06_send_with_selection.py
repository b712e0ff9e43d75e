"""send() to all actors or to one chosen actor, with the answers through a port."""
from monarch.actor import Actor, Channel, endpoint, send, this_host


class Echo(Actor):
    @endpoint
    def echo(self, text: str) -> str:
        return text.upper()


procs = this_host().spawn_procs(per_host={"gpus": 4})
echo = procs.spawn("echo", Echo)
port, receiver = Channel.open()
send(echo.echo, ("hello",), {}, port=port, selection="all")
print(sorted(receiver.recv().get() for _ in range(4)))
port, receiver = Channel.open()
send(echo.echo, ("one",), {}, port=port, selection="choose")
print(receiver.recv().get())
print(echo.echo.choose("chosen").get())
procs.stop().get()
