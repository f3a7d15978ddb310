"""The SlideDP engine: device-agnostic, knows nothing of Lightning."""

from slidedp_lightning.runtime.config import EngineConfig
from slidedp_lightning.runtime.engine import SlideDPEngine
from slidedp_lightning.runtime.topology import Topology

__all__ = ["EngineConfig", "SlideDPEngine", "Topology"]
