"""A ProcessJob's hosts: several hosts on one machine, each starting its own processes; stop with the job."""
import os

from monarch.actor import Actor, endpoint
from monarch.config import configured
from monarch.job import ProcessJob


class Where(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


job = ProcessJob({"trainers": 2, "loaders": 1})
state = job.state(cached_path=None)
with configured(stop_actor_timeout="20s"):
    trainers = state.trainers.spawn_procs(per_host={"gpus": 2})
    loaders = state.loaders.spawn_procs(per_host={"procs": 1})
    print(trainers.initialized.get(), loaders.initialized.get())
    pids = trainers.spawn("where", Where).pid.call().get()
    print(len(set(pids.values())), [str(point) for point, _ in pids.items()])
    print([str(point) for point, _ in loaders.spawn("where", Where).pid.call().get().items()])
    print(state.trainers.shutdown().get())
job.kill()
