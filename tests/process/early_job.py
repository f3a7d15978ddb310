"""A script-launched "job" for tests/process/test_early_ranks.py: ``python early_job.py RANKS MODE OUT``.

Local rank 0 starts the other ranks early, then, by MODE: ``launch`` (imports Lightning; its script launcher takes
them over), ``changed-command`` (the same, its command changed first: the launcher starts new ones), ``exit`` (ends
without launching) or ``killed`` (SIGKILLs itself), both once the others have started. Every process writes
``OUT/<pid>.start`` as it starts and ``OUT/<pid>.json`` at its end: its local rank, when it started, when rank 0 had
imported Lightning, and what its environment holds once launched. The other ranks import nothing heavy: the test is
of their start and hand-over, not of their imports.
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
local_rank = int(os.environ.get("LOCAL_RANK", "0"))


def write(suffix: str, content: dict) -> None:
    """``OUT/<pid><suffix>``, whole or not at all (a rank killed as it writes leaves no empty file behind)."""
    tmp = out / f"{os.getpid()}{suffix}.tmp"
    tmp.write_text(json.dumps(content))
    os.replace(tmp, out / f"{os.getpid()}{suffix}")


write(".start", {"started": started, "early": was_early})
NAMES = ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "NODE_RANK", early_ranks.ENV)


def report(**more) -> None:
    env = {k: os.environ.get(k) for k in NAMES}
    write(".json", {"local_rank": local_rank, "early": was_early, "started": started, "env": env, **more})


if local_rank != 0:
    early_ranks.wait_for_launch()
    report()
    sys.exit(0)
if mode in ("exit", "killed"):
    while len(list(out.glob("*.start"))) < ranks:  # the others have started
        time.sleep(0.01)
    if mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    report()
    sys.exit(0)

from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402

from slidedp_lightning.process.launcher import TrainerScriptLauncher  # noqa: E402

imported = time.time()
if mode == "changed-command":
    sys.argv.append("--again")
launcher = TrainerScriptLauncher(LightningEnvironment(), ranks, 1)
launcher._call_children_scripts()
report(imported=imported, children=[proc.pid for proc in launcher.procs],
       codes=[proc.wait(timeout=120) for proc in launcher.procs])  # fmt: skip
