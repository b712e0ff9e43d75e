"""R39, as it runs now: a reader of the Slurm cluster's network tries to take a persistent mesh over.

The review's R39 (shared/reviews/repro) read the persistent mesh's secret off the direct link and the
direct link's own secret off srun's I/O, then attached from another host as another user and had the
node's agent write a file. Since the links are encrypted (wire/link_crypto.py) and the Slurm step's link
is keyed by munge credentials (wire/munge_auth.py), this script repeats the attack against this checkout:

- the same raw packet socket on the cluster bridge records every TCP payload while a persistent Slurm
  mesh starts (with an `env=` value) and runs a push;
- it looks for the persistent mesh's secret (as bytes and as hex), the environment's value and the
  pushed bytes in every flow, and tries the old way of reading frames (length-prefixed pickles);
- as uid 65534 it tries to attach on the node's persist port with what it found, or a guess if nothing.

Expected (and shown): nothing found in any flow; the attach is refused; no file is written; the kernel's
mesh goes on.

Run as root from the root of a checkout with its venv (needs slurmctld, slurmd, munge):
    .venv/bin/python scripts/repro/r39_slurm_network_reader.py
"""
import asyncio  # noqa: F401  (the attacker's script imports it too)
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import slurmlab  # noqa: E402
from wiretap import WireTap  # noqa: E402

ATTACKER = textwrap.dedent("""
    import asyncio, os, sys, time
    from monarch_kernel.wire import persist_messages as pm
    from monarch_kernel.wire.direct_auth import AuthenticationFailed, prove_controller_async
    host, port, secret = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    async def go():
        r, w = await asyncio.open_connection(host, port)
        try:
            await prove_controller_async(r, w, secret)
        except AuthenticationFailed as exc:
            print("ATTACKER uid", os.getuid(), "refused by the node's agent:", exc, flush=True)
            return
        print("ATTACKER uid", os.getuid(), "GOT IN", flush=True)
    asyncio.run(go())
    """)


def old_frames(data: bytes) -> list[object]:
    """What the old sealed link's frames would give a reader: pickles after (sequence, length, MAC) headers."""
    found, at = [], 0
    while at + 48 <= len(data):
        length = int.from_bytes(data[at + 8:at + 16], "big")
        if length > len(data):
            break
        try:
            found.append(pickle.loads(data[at + 48 + 16:at + 48 + length]))
        except Exception:  # noqa: BLE001 - not a frame
            break
        at += 48 + length
    return found


work = tempfile.mkdtemp(prefix="r39-")
os.chmod(work, 0o711)
lab = slurmlab.SlurmTestCluster(1, os.path.join(work, "lab"))
os.makedirs(lab.workdir)
state = os.path.join(work, "state")
os.mkdir(state, 0o700)
token = "token-" + os.urandom(8).hex()
marker = os.urandom(64)
try:
    lab.start()
    os.environ.update(lab.env)
    os.environ["XDG_STATE_HOME"] = state
    import monarch_kernel as mk

    with WireTap(lab.bridge) as tap:
        mesh = mk.slurm_mesh(nodes=1, gpus=1, dist="none", request_gpus=False, python=sys.executable,
                             name="r39keep", persist="5m", env={"MY_API_TOKEN": token})
        mesh.push(blob=marker * 256)
        time.sleep(1)
    step = mesh._runtime.links[0].host.remote
    print("mesh up on", mesh._runtime.links[0].host.address, "over", step.channel)
    record = mesh._runtime.record
    secret = bytes.fromhex(record.secret)
    streams = tap.streams()
    print(f"the tap recorded {len(streams)} flows, {sum(len(s) for s in streams)} bytes")
    for what, needle in (("the persistent mesh's secret", secret), ("... as hex", record.secret.encode()),
                         ("the environment's value", token.encode()), ("the pushed bytes", marker)):
        print(f"  {what}: {'FOUND' if tap.seen(needle) else 'not found'}")
    print("  frames readable the old way:", sum(len(old_frames(s)) for s in streams))
    address, port = record.agents[0]["socket"][4:].rsplit(":", 1)
    script = os.path.join(work, "attacker.py")
    with open(script, "w") as f:
        f.write(ATTACKER)
    os.chmod(script, 0o644)
    guess = os.urandom(32).hex()  # nothing was found: the best the reader has
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, script,
                           address, port, guess], capture_output=True, text=True, timeout=60, cwd="/")
    print(done.stdout.strip() or done.stderr.strip()[-600:])
    print("kernel: its mesh answers", list(mesh.run("1", sink=None, timeout=20).values()))
    from monarch_kernel.api.persistent import stop_persistent
    print(stop_persistent("r39keep"))
finally:
    lab.stop()
    subprocess.run(["rm", "-rf", work])
