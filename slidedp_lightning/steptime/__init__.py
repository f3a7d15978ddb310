"""Step-time model of SlideDP (arXiv 2609.34162, §3.5): hardware profiles, per-resource bounds and a lane simulator.

Imports nothing of Lightning; the runtime never imports this package.
"""

from slidedp_lightning.steptime.analytic import Analytic, analyze
from slidedp_lightning.steptime.graph import StepConfig
from slidedp_lightning.steptime.profiles import Profile, load_profile, shipped_profiles
from slidedp_lightning.steptime.simulate import SimResult, simulate
from slidedp_lightning.steptime.workload import ModelShape, UnitActivation, load_config

__all__ = [
    "Analytic",
    "ModelShape",
    "Profile",
    "SimResult",
    "StepConfig",
    "UnitActivation",
    "analyze",
    "load_config",
    "load_profile",
    "shipped_profiles",
    "simulate",
]
