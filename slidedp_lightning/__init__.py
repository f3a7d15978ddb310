"""SlideDP for PyTorch Lightning: full-parameter fine-tuning of models larger than device memory.

``import slidedp_lightning`` registers ``Trainer(strategy="slidedp")`` (and ``"slidedp_spawn"``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from slidedp_lightning.precision import SlideDPPrecision
from slidedp_lightning.strategy import SlideDPStrategy

if "slidedp" not in StrategyRegistry:
    SlideDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["SlideDPPrecision", "SlideDPStrategy"]
__version__ = "0.1.0"
