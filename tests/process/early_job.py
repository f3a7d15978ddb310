"""A script-launched "job" for tests/process/test_early_ranks.py: ``python early_job.py RANKS MODE OUT``.

Local rank 0 starts the other ranks early (before importing Lightning), imports it, then, by MODE: ``launch`` (its
script launcher takes them over), ``changed-command`` (its command changes first: the launcher starts new ones),
``exit`` (ends without launching), ``killed`` (SIGKILLs itself). Every process writes ``OUT/<pid>.json``: its local
rank, when it started and what its environment holds once launched.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

started = time.time()
ranks, mode, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])

from slidedp_lightning_cli.task import early_ranks  # noqa: E402  (plain Python: before the heavy imports)

early_ranks.begin(ranks)
was_early = early_ranks.ENV in os.environ
(out / f"{os.getpid()}.start").write_text(json.dumps({"started": started, "early": was_early}))

from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402

from slidedp_lightning.process.launcher import TrainerScriptLauncher  # noqa: E402

imported = time.time()
early_ranks.wait_for_launch()
report = {
    "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
    "early": was_early,
    "started": started,
    "imported": imported,
    "env": {k: os.environ.get(k) for k in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "NODE_RANK", early_ranks.ENV)},
}
if report["local_rank"] == 0:
    if mode == "killed":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit":
        (out / f"{os.getpid()}.json").write_text(json.dumps(report))
        sys.exit(0)
    if mode == "changed-command":
        sys.argv.append("--again")
    launcher = TrainerScriptLauncher(LightningEnvironment(), ranks, 1)
    launcher._call_children_scripts()
    report["env"] = {k: os.environ.get(k) for k in report["env"]}  # as the launcher set it
    report["children"] = [proc.pid for proc in launcher.procs]
    report["codes"] = [proc.wait(timeout=120) for proc in launcher.procs]
(out / f"{os.getpid()}.json").write_text(json.dumps(report))
