"""devicekit.jobs: starting and supervising the processes of a job.

Everything ``devicekit run`` and ``dk.launch`` do before and around the ranks: read what was
asked (``request``), the world an outer launcher (srun, mpirun, torchrun, a Kubeflow pod) already
set (``outer``, ``run_world``), lease devices and share them among processes (``allocation``),
build and start the command, directly or under torchrun (``run``, ``torchrun_entry``), and
supervise it: signals, exit codes, no orphans (``supervise``), Slurm's warning signals and
``--requeue`` (``preempt_signals``, ``requeue``), hangs (``run_doctor``; ``step_doctor`` when
srun starts the ranks); ``dk.launch(fn)`` from Python with
its rank processes (``launch``, ``rank_process``) and thread counts (``threads``).
What runs *inside* a rank (process group, DDP, FSDP) is :mod:`devicekit.parallel`, one floor down.
(Named ``jobs``, not ``launch``, so that the package does not shadow the function ``dk.launch``.)

May import: ``units``, ``errors``, ``hardware``, ``sharing``, ``selection``, ``placement``,
``memory``, ``parallel``. Never ``strategy``, ``cli``, ``integrations``. Tests: ``tests/jobs/``.

Usage::

    import devicekit as dk
    from devicekit.jobs.run import RunRequest, plan_run, run

    results = dk.launch(train, nprocs=2, timeout=600)          # Python: supervised ranks
    code = run(RunRequest(gpus=2, command=["python", "train.py"]))   # what `devicekit run` does
    plan = plan_run(RunRequest(procs=2, command=["python", "x.py"]))  # leases, starts nothing
    plan.allocation.release()
"""
