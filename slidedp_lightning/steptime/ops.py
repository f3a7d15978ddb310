"""The ops of a step of either system the step-time model knows: SlideDP's (:mod:`.graph`) or the replicated
baseline's (:mod:`.slideformer`, ``StepConfig(param_route="slideformer")``)."""

from __future__ import annotations

from slidedp_lightning.steptime.graph import Op, StepConfig, slidedp_ops
from slidedp_lightning.steptime.profiles import COMPUTE_PRECISION_KEY, Profile
from slidedp_lightning.steptime.slideformer import slideformer_ops


def build_ops(cfg: StepConfig, profile: Profile, steps: int = 2) -> list[Op]:
    """The ops of ``steps`` consecutive steps of one rank, in lane order (list order = order within a lane)."""
    profile.check_gpus(cfg.gpus)
    profile.check_hosts(cfg.hosts)
    if cfg.state_on_disk and "disk_gbps" not in profile.values:
        raise ValueError(
            f"profile {profile.name!r} has no disk_gbps, the state file's disk: calibrate with --state-dir DIR "
            "(or add the mixed read/write rate of `python -m bench.disk_ceiling --dir DIR`) to model state on disk"
        )
    measured = profile.values.get(COMPUTE_PRECISION_KEY)
    if measured is not None and measured != cfg.precision:
        raise ValueError(
            f"profile {profile.name!r} timed its compute in {measured}, this step runs {cfg.precision}: calibrate "
            f"with --precision {cfg.precision} for its rates"
        )
    if cfg.param_route == "slideformer":
        return slideformer_ops(cfg, profile, steps)
    return slidedp_ops(cfg, profile, steps)
