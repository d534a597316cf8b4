"""Record the variables a real Slurm gives each way it starts processes, for the fast tests.

``python -m tests.slurm.record_environments`` (as root, with slurm-wlm and munge installed)
starts the test clusters of :mod:`tests.slurm.cluster` (one node, two nodes, and one with
salloc's interactive step) and writes ``tests/hardware/slurm_environments.json``: per case,
the command and each process's Slurm variables, sorted by task. Machine-specific values
(paths, ports, pids, the host name) are left out or replaced, so the file is the same from
one recording to the next. ``tests/hardware/test_slurm_environments.py`` reads it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.slurm.cluster import SlurmCluster

OUT = Path(__file__).resolve().parents[1] / "hardware" / "slurm_environments.json"
#: writes this process's environment to a file of its own in $DK_RECORD (tasks run side by side)
PRINT_ENV = (f"{sys.executable} -c 'import json, os; open(os.path.join(os.environ[\"DK_RECORD\"],"
             " str(os.getpid())), \"w\").write(json.dumps(dict(os.environ)))'")
_DROP = {"SLURM_CONF", "SLURM_SUBMIT_DIR", "SLURM_WORKING_CLUSTER", "SLURM_TASK_PID",
         "SLURM_SRUN_COMM_PORT", "SLURM_STEP_LAUNCHER_PORT", "SLURM_CLUSTER_NAME",
         "SLURM_SUBMIT_HOST", "SLURM_SRUN_COMM_HOST", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_UMASK"}
_KEEP = ("SLURM_", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "SLURMD_NODENAME")

#: case -> (cluster, command); ``{env}`` is PRINT_ENV
CASES: dict[str, tuple[str, list[str]]] = {
    "salloc_shell": ("one", ["salloc", "-n", "2", "--gres=gpu:2", "bash", "-c", "{env}"]),
    "salloc_srun": ("one", ["salloc", "-n", "2", "--gres=gpu:2", "srun", "-n", "2", "bash", "-c",
                            "exec {env}"]),
    "salloc_n4_srun_n2": ("one", ["salloc", "-n", "4", "srun", "-n", "2", "bash", "-c", "exec {env}"]),
    "srun_bash_c": ("one", ["srun", "-n", "2", "bash", "-c", "echo wrapped; {env}"]),
    "sbatch_script": ("one", ["sbatch-script"]),
    "sbatch_srun": ("one", ["sbatch-srun"]),
    "srun_ntasks_per_node_two_nodes": ("two", ["srun", "-N", "2", "--ntasks-per-node=2", "bash",
                                               "-c", "exec {env}"]),
    "srun_uneven_two_nodes": ("two", ["srun", "-N", "2", "-n", "3", "bash", "-c", "exec {env}"]),
    "salloc_interactive_step": ("interactive", ["salloc", "-n", "2"]),
}


def _clean(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(_KEEP) and k not in _DROP}


def _collect(folder: Path) -> list[dict[str, str]]:
    found = [_clean(json.loads(path.read_text())) for path in folder.iterdir()]
    return sorted(found, key=lambda e: int(e.get("SLURM_PROCID", "0")))


def _record(cluster: SlurmCluster, argv: list[str], tmp: Path) -> list[dict[str, str]]:
    folder = Path(tempfile.mkdtemp(dir=tmp))
    env = {"DK_RECORD": str(folder)}
    if argv == ["sbatch-script"] or argv == ["sbatch-srun"]:
        body = PRINT_ENV if argv == ["sbatch-script"] else f"srun -n 2 {PRINT_ENV}"
        job = cluster.submit(f"#!/bin/bash\n#SBATCH -n 2\n#SBATCH --gres=gpu:2\n{body}\n", cwd=tmp,
                             env=env)
        cluster.wait_for_job(job)
        return _collect(folder)
    if argv == ["salloc", "-n", "2"]:  # no command: the interactive step's shell reads stdin
        out = cluster.run(argv, input=PRINT_ENV + "\n", timeout=60, env=env)
    else:
        out = cluster.run([a.replace("{env}", PRINT_ENV) for a in argv], timeout=60, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{argv}: {out.stderr.strip()}")
    return _collect(folder)


def main() -> None:
    recorded: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {
            "one": SlurmCluster.start(Path(tmp) / "one"),
            "two": SlurmCluster.start(Path(tmp) / "two", nodes=2),
            "interactive": SlurmCluster.start(Path(tmp) / "interactive",
                                              extra_conf="LaunchParameters=use_interactive_step\n"),
        }
        try:
            for case, (which, argv) in CASES.items():
                shown = " ".join(a if "{env}" not in a else a.replace("{env}", "<print env>")
                                 for a in argv)
                recorded[case] = {"command": shown, "processes": _record(clusters[which], argv, Path(tmp))}
                print(case, len(recorded[case]["processes"]), "process(es)")  # type: ignore[arg-type]
        finally:
            for cluster in clusters.values():
                cluster.stop()
    OUT.write_text(json.dumps({"slurm": "slurm-wlm 22.05 (Debian), tests/slurm/cluster.py",
                               "cases": recorded}, indent=1, sort_keys=True) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
