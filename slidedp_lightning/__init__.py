"""SlideDP for PyTorch Lightning: full-parameter fine-tuning of models larger than device memory.

``import slidedp_lightning`` registers ``Trainer(strategy="slidedp")`` and ``Fabric(strategy="slidedp")`` (and
``"slidedp_spawn"`` for both).
"""

import logging

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from slidedp_lightning.callbacks import LaneTrace, SaveHuggingFace
from slidedp_lightning.fabric import SlideDPFabricStrategy
from slidedp_lightning.hf.pretrained import from_pretrained
from slidedp_lightning.models.block_list import stream_blocks
from slidedp_lightning.models.chunked_loss import use_chunked_loss
from slidedp_lightning.options import StateOnDisk
from slidedp_lightning.precision import SlideDPFabricPrecision, SlideDPPrecision
from slidedp_lightning.strategy import SlideDPStrategy

# like Lightning's own logger: show what the strategy decided unless the application configured logging
_logger = logging.getLogger(__name__)
if not logging.getLogger().hasHandlers() and not _logger.handlers:
    _logger.setLevel(logging.INFO)
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

if "slidedp" not in StrategyRegistry:
    SlideDPStrategy.register_strategies(StrategyRegistry)
if "slidedp" not in FABRIC_STRATEGY_REGISTRY:
    SlideDPFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "LaneTrace",
    "SaveHuggingFace",
    "SlideDPFabricPrecision",
    "SlideDPFabricStrategy",
    "SlideDPPrecision",
    "SlideDPStrategy",
    "StateOnDisk",
    "from_pretrained",
    "stream_blocks",
    "use_chunked_loss",
]
__version__ = "0.1.0"
