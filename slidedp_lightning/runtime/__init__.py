"""The SlideDP engine: device-agnostic, knows nothing of Lightning."""

from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine

__all__ = ["EngineConfig", "SlideDPEngine"]
