"""A real, one-node Slurm cluster for the tests: munged, slurmctld and slurmd on localhost.

Debian's ``slurm-wlm`` (22.05) and ``munge`` are started from a private temporary directory
with their own key, sockets, state, spool and free TCP ports, so several clusters (one per
pytest-xdist worker) run side by side and none touches the machine's own Slurm. Four fake
GPUs are gres backed by ``mknod`` character devices (``AutoDetect=off``): Slurm then sets
``CUDA_VISIBLE_DEVICES`` and ``SLURM_JOB_GPUS`` for a job exactly as on a GPU node.

Usage::

    from tests.slurm.cluster import SlurmCluster, slurm_missing

    if slurm_missing() is None:
        with SlurmCluster.start(tmp_path) as cluster:
            out = cluster.run(["srun", "-n", "2", "hostname"])
            print(out.stdout)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SlurmCluster", "slurm_missing", "node_names", "NODE", "GPUS", "CPUS"]

#: the node's name in slurm.conf (slurmd runs as it with -N), its CPUs and fake GPUs
NODE = "dknode"
CPUS = 8
GPUS = 4
_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "salloc", "scontrol", "sinfo",
          "squeue", "scancel")


def slurm_missing() -> str | None:
    """Why a real Slurm cannot run here, or None when it can."""
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                "apt-get install --no-install-recommends slurm-wlm munge")
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root (mknod, slurmd): not root here"
    if Path("/dev/nvidiactl").exists():
        # Slurm sets CUDA_VISIBLE_DEVICES=0,1 for a job's fake gres: torch in that job would
        # open this machine's real GPUs, and the suite never touches them unless marked gpu
        return "this machine has NVIDIA GPUs: the fake-gres Slurm tests would reach them"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_ports(count: int, *, tries: int = 50) -> int:
    """The first of ``count`` consecutive free ports (one per slurmd)."""
    for _ in range(tries):
        first = _free_port()
        if first + count > 65535:
            continue
        socks = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def node_names(nodes: int) -> list[str]:
    """The nodes' names in slurm.conf: ``dknode``, then ``dknode2``, ``dknode3``, ..."""
    return [NODE] + [f"{NODE}{i}" for i in range(2, nodes + 1)]


def _nodes_conf(nodes: int, slurmd_port: int) -> str:
    """One NodeName line per node; several slurmd on this host each listen on a port of their own."""
    lines = []
    for i, name in enumerate(node_names(nodes)):
        port = f" Port={slurmd_port + i}" if nodes > 1 else ""
        lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()}{port}"
                     f" CPUs={CPUS} RealMemory=4000 Gres=gpu:{GPUS} State=UNKNOWN")
    names = ",".join(node_names(nodes))
    return "\n".join(lines) + (f"\nPartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE"
                               " State=UP OverSubscribe=NO\n")


def _conf(root: Path, ctld_port: int, slurmd_port: int, munge_socket: Path, nodes: int = 1) -> str:
    many = "-%n" if nodes > 1 else ""  # several slurmd: a pid and log file each
    return f"""\
ClusterName=dk{os.getpid()}
MailProg=/bin/true
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd{many}.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd{many}.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=2
KillWait=2
MessageTimeout=10
JobRequeue=1
PlugStackConfig={root}/plugstack.conf
""" + _nodes_conf(nodes, slurmd_port)


@dataclass
class SlurmCluster:
    """A running test cluster; ``env`` is what a client (sbatch, srun, ...) needs to reach it."""

    root: Path
    conf: Path
    gpu_devices: list[str]
    #: the nodes' names (``nodes=2``: two slurmd on this host, each a node of its own)
    nodes: list[str] = field(default_factory=lambda: [NODE])
    _procs: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path, *, timeout: float = 30.0, nodes: int = 1,
              extra_conf: str = "") -> SlurmCluster:
        """Start munged, slurmctld and slurmd under ``root``; return once the node is idle.

        ``nodes=2`` (or more) starts one slurmd per node on this host (Debian's build has
        multiple-slurmd support), so steps over several nodes run for real. ``extra_conf``:
        lines added to slurm.conf (e.g. ``LaunchParameters=use_interactive_step``)."""
        why = slurm_missing()
        if why:
            raise RuntimeError(why)
        root = Path(root)
        for sub in ("state", *(f"spool/{name}" for name in node_names(nodes)), "munge", "dev"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)  # munged wants its socket's directories searchable by all
        os.chmod(root / "munge", 0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        munge_socket = root / "munge" / "munge.socket"
        devices = []
        for index in range(GPUS):
            dev = root / "dev" / f"fakegpu{index}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a char device, like /dev/null
            devices.append(str(dev))
        (root / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={','.join(node_names(nodes))} Name=gpu"
            f" File={root}/dev/fakegpu[0-{GPUS - 1}]\n")
        (root / "plugstack.conf").write_text("")
        conf = root / "slurm.conf"
        slurmd_port = _free_port() if nodes == 1 else _free_ports(nodes)
        conf.write_text(_conf(root, _free_port(), slurmd_port, munge_socket, nodes) + extra_conf)
        cluster = cls(root=root, conf=conf, gpu_devices=devices, nodes=node_names(nodes))
        try:
            cluster._spawn(["munged", "-F", "--force", f"--key-file={key}",
                            f"--socket={munge_socket}", f"--pid-file={root}/munge/munged.pid",
                            f"--log-file={root}/munge/munged.log",
                            f"--seed-file={root}/munge/munged.seed"], "munged")
            cluster._wait(lambda: munge_socket.exists(), timeout, "munged's socket")
            cluster._spawn(["slurmctld", "-D", "-i", "-f", str(conf)], "slurmctld")
            for name in cluster.nodes:
                cluster._spawn(["slurmd", "-D", "-N", name, "-f", str(conf)],
                               "slurmd" if name == NODE else f"slurmd-{name}")
            cluster._wait(cluster._node_ready, timeout, "the node to become idle in sinfo")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def env(self) -> dict[str, str]:
        """This process's environment now (a test's own variables included), pointed at this
        cluster, without the Slurm variables of any job this process may itself be in."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.out", "wb")  # noqa: SIM115 (closed with the process)
        self._procs.append(subprocess.Popen(argv, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}) while waiting"
                                       f" for {what}: {self.logs()}")
            if ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}: {self.logs()}")

    def _node_ready(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True,
                             text=True, timeout=10)
        states = out.stdout.split()
        return (out.returncode == 0 and len(states) == len(self.nodes)
                and all(state in ("idle", "mix", "alloc") for state in states))

    def logs(self) -> str:
        """The tail of every daemon log, for a failure message."""
        parts = []
        for path in sorted(self.root.rglob("*.log")) + sorted(self.root.glob("*.out")):
            text = path.read_text(errors="replace").strip().splitlines()[-8:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike | None = None, input: str | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster (bounded in time)."""
        return subprocess.run(list(argv), env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, cwd=cwd, input=input)

    def submit(self, script: str, *, cwd: Path, args: Sequence[str] = (),
               env: Mapping[str, str] | None = None) -> str:
        """``sbatch`` a script (its text); the job id. Output goes to ``cwd/slurm-<id>.out``."""
        path = Path(cwd) / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        out = self.run(["sbatch", "--parsable", *args, str(path)], cwd=cwd, env=env, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def clear(self, *, timeout: float = 20.0) -> None:
        """Cancel every job and wait until the queue is empty (between tests)."""
        self.run(["scancel", "--full", "-u", "root"], timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["squeue", "-h", "-o", "%i"], timeout=10)
            if out.returncode == 0 and not out.stdout.strip():
                return
            time.sleep(0.1)
        raise TimeoutError(f"jobs still queued after {timeout:.0f} s: {out.stdout.strip()}")

    def wait_for_job(self, job_id: str, *, timeout: float = 60.0) -> str:
        """Wait until the job has left the queue; return its last state from ``scontrol``."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            out = self.run(["scontrol", "-o", "show", "job", job_id], timeout=10)
            if out.returncode != 0:  # purged (MinJobAge): it has finished
                return state
            for word in out.stdout.split():
                if word.startswith("JobState="):
                    state = word.split("=", 1)[1]
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                             "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT"):
                return state
            time.sleep(0.1)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")

    def stop(self) -> None:
        """Stop the daemons (SIGTERM, then SIGKILL) and every job step they left."""
        if self._procs and all(proc.poll() is None for proc in self._procs):
            try:  # every job's steps first, while slurmctld can still signal them
                subprocess.run(["scancel", "--full", "-u", "root"], env=self.env,
                               capture_output=True, timeout=5, check=False)
            except subprocess.TimeoutExpired:
                pass
        for proc in reversed(self._procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 15)
                except ProcessLookupError:
                    pass
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=5)
        self._procs.clear()
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """SIGKILL every process still pointed at this cluster's slurm.conf: a ``slurmstepd``
        outlives a slurmd stopped while its batch step ran, with the job's processes under it."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), 9)
            except (OSError, ValueError):
                continue  # gone already, or not ours to read

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # a quick manual check: python -m tests.slurm.cluster
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, SlurmCluster.start(Path(tmp)) as cluster:
        print(cluster.run(["sinfo"]).stdout)
        print(cluster.run(["srun", "-n", "2", "--gres=gpu:2", "bash", "-c",
                           "echo $SLURM_PROCID $CUDA_VISIBLE_DEVICES $SLURM_STEP_ID"]).stdout)
        sys.exit(0)
