"""Reading ``scontrol -d -o show job``: a job's GPUs on one node, by pattern, bounded."""

from __future__ import annotations

from devicekit.hardware.slurm_node import SlurmJobGpus, SlurmView, parse_job_gpus

#: recorded from slurm-wlm 22.05 (tests/slurm/cluster.py), the tail shortened
LINE = ("JobId=2 JobName=job-1381617106758.sh UserId=root(0) GroupId=root(0) MCS_label=N/A"
        " JobState=RUNNING Reason=None NodeList=dknode BatchHost=dknode NumNodes=1 NumCPUs=1"
        " NumTasks=1 CPUs/Task=1 TRES=cpu=1,node=1,billing=1 JOB_GRES=gpu:1"
        "   Nodes=dknode CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:2) MinCPUsNode=1 TresPerNode=gres:gpu:1")


def test_a_jobs_gpus_on_this_node() -> None:
    assert parse_job_gpus(LINE, "dknode") == SlurmJobGpus("2", "root", (2,))
    assert parse_job_gpus(LINE, "othernode") == SlurmJobGpus("2", "root", ())


def test_several_nodes_types_ranges_and_array_tasks() -> None:
    line = ("JobId=11 ArrayJobId=10 ArrayTaskId=1 UserId=alice(1000) JobState=RUNNING"
            " Nodes=gpu[01-02] CPU_IDs=0-3 Mem=0 GRES=gpu:a100:3(IDX:0-1,3)"
            " Nodes=gpu03 CPU_IDs=0 Mem=0 GRES=gpu:a100:1(IDX:5)")
    assert parse_job_gpus(line, "gpu02") == SlurmJobGpus("10_1", "alice", (0, 1, 3))
    assert parse_job_gpus(line, "gpu03").gpus == (5,)


def test_unreadable_text_is_none_not_an_error() -> None:
    assert parse_job_gpus("", "n") is None
    assert parse_job_gpus("slurm_load_jobs error: Invalid job id specified", "n") is None
    odd = "JobId=3 UserId=$(rm -rf ~)(0) Nodes=n[9-1] CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:x)"
    assert parse_job_gpus(odd, "n") == SlurmJobGpus("3", "?", ())


def test_the_lines_status_and_doctor_print() -> None:
    view = SlurmView("dknode", "7", "srun step 0", (1, 2), [SlurmJobGpus("4", "bob", (0,))])
    assert view.lines() == ["Slurm job 7 (srun step 0): GPU 1,2 of node dknode",
                            "GPU 0: taken by Slurm job 4 (bob)"]
    assert view.to_dict()["taken"] == [{"gpu": 0, "job_id": "4", "user": "bob"}]
    assert SlurmView("n", "8", "the sbatch script", ()).lines() == [
        "Slurm job 8 (the sbatch script): no GPUs of node n"]
