"""Lightning's script launchers (Trainer's and Fabric's), taking over the ranks the command started early.

Where the command started local ranks 1..n-1 early (:mod:`.early_ranks`: the same command, before its imports), the
launcher hands those processes the environment it would have started them with instead of starting new ones; it
then watches, signals and reaps them as its own. Otherwise (none started early, another command, Hydra's working
directories) it lets the ones started early go and starts its ranks as Lightning does.
"""

from __future__ import annotations

import logging
import os

from lightning.fabric.strategies.launchers.subprocess_script import _HYDRA_AVAILABLE, _basic_subprocess_cmd
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as _FabricSubprocessScriptLauncher,
)
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as _TrainerSubprocessScriptLauncher

from slidedp_lightning.process import early_ranks

log = logging.getLogger(__name__)


def _hydra_in_use() -> bool:
    if not _HYDRA_AVAILABLE:
        return False
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized()


class _HandsOverEarlyRanks:
    """Mixed in before a Lightning ``_SubprocessScriptLauncher``: its ``_call_children_scripts``."""

    num_processes: int
    num_nodes: int

    def _call_children_scripts(self) -> None:
        if _hydra_in_use() or not early_ranks.started(_basic_subprocess_cmd(), self.num_processes - 1):
            early_ranks.discard()
            super()._call_children_scripts()  # type: ignore[misc]
            return
        self._check_can_spawn_children()  # type: ignore[attr-defined]
        environment = self.cluster_environment  # type: ignore[attr-defined]
        # the variables Lightning's launcher sets before it starts the ranks, and each rank's LOCAL_RANK
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        os.environ["NODE_RANK"] = str(environment.node_rank())
        os.environ["LOCAL_RANK"] = str(environment.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        envs = [{**os.environ, "LOCAL_RANK": str(local_rank)} for local_rank in range(1, self.num_processes)]
        self.procs = early_ranks.hand_over(envs)
        log.debug(
            "SlideDP started local rank(s) %s before the imports (pid %s): the launcher hands them its environment",
            ", ".join(str(rank) for rank in range(1, self.num_processes)),
            ", ".join(str(proc.pid) for proc in self.procs),
        )


class TrainerScriptLauncher(_HandsOverEarlyRanks, _TrainerSubprocessScriptLauncher):
    """The Trainer's script launcher, taking over ranks started early."""


class FabricScriptLauncher(_HandsOverEarlyRanks, _FabricSubprocessScriptLauncher):
    """Fabric's script launcher, taking over ranks started early."""


__all__ = ["FabricScriptLauncher", "TrainerScriptLauncher"]
