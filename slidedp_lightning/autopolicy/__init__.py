"""AutoPolicy (arXiv 2609.34162, §3.7): probe -> calibrate -> solve, for the per-block activation policy."""

from slidedp_lightning.autopolicy.planner import AutoPolicy, Plan
from slidedp_lightning.autopolicy.solve import Option, solve

__all__ = ["AutoPolicy", "Option", "Plan", "solve"]
