"""with_python_executable: new processes, and those their actors start, run the given interpreter."""
import os
import stat
import sys
import tempfile

from monarch.actor import Actor, endpoint, this_host

folder = tempfile.mkdtemp()
wrapper = os.path.join(folder, "python")
with open(wrapper, "w") as out:
    out.write(f'#!/bin/sh\nexport STARTED_BY_WRAPPER=$$\nexec {sys.executable} "$@"\n')
os.chmod(wrapper, stat.S_IRWXU)


class Marker(Actor):
    @endpoint
    def wrapper_pid(self) -> str:
        return os.environ.get("STARTED_BY_WRAPPER", "")

    @endpoint
    def inner(self) -> "Marker":
        return this_host().spawn_procs(per_host={"procs": 1}).spawn("inner", Marker)


print(this_host().is_fake_in_process)
plain = this_host().spawn_procs(per_host={"procs": 1}).spawn("plain", Marker)
print("plain:", repr(plain.wrapper_pid.call_one().get()))
markers = this_host().with_python_executable(wrapper).spawn_procs(per_host={"procs": 1}).spawn("marked", Marker)
outer = markers.wrapper_pid.call_one().get()
inner = markers.inner.call_one().get().wrapper_pid.call_one().get()
print("wrapped:", outer != "", "inner wrapped too:", inner != "", "by another run of it:", inner != outer)
