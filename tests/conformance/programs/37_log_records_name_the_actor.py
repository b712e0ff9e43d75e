"""Log records made in an actor start with the actor's name ("[actor=<root>.<mod.Class name{...}>] "), in the
client with "[actor=<root>] "; monarch.actor.config.prefix_python_logs_with_actor = False turns that off."""
import io
import logging

import monarch.actor
from monarch.actor import Actor, endpoint, this_host


def captured(message: str) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("program37")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        logger.info(message)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().strip()


class Named(Actor):
    @endpoint
    def log(self) -> str:
        return captured("from the actor")

    @endpoint
    def log_without_prefix(self) -> str:
        monarch.actor.config.prefix_python_logs_with_actor = False
        try:
            return captured("plain")
        finally:
            monarch.actor.config.prefix_python_logs_with_actor = True


procs = this_host().spawn_procs(per_host={"gpus": 2})
named = procs.spawn("the_name", Named)
print(named.slice(gpus=1).log.call_one().get().replace("__main__.", ""))
print(named.slice(gpus=0).log_without_prefix.call_one().get())
print(captured("from the client"))
procs.stop().get()
