"""The lifetime of a job's processes: :mod:`.groups` (the default process group: backend, claim, destroy),
:mod:`.signals` (SIGTERM and SIGINT during a run, ranks that outlive their launcher) and :mod:`.requeue` (SLURM
auto-requeue at the end of a step)."""
