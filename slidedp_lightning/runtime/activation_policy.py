"""The activation plan: how each decoder-block unit keeps its activations (arXiv 2609.34162, §3.6).

:class:`UnitPolicy` is one unit's mode (``none``, ``full``, ``segments:mask``, ``selective``) and offload ratio;
:class:`ActivationPolicy` a default with overrides by unit name. The mechanism that runs them is
:mod:`slidedp_lightning.runtime.lanes.activations`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

MODES = ("none", "full", "segments", "selective")


MASK_BITS = 7


@dataclass(frozen=True)
class UnitPolicy:
    """How one unit keeps its activations: a mode, a segment mask and an offload ratio in [0, 1]."""

    mode: str = "none"
    mask: int = 0  # segments: bit i set = activations kept at internal boundary i (0..6)
    offload: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"activation mode must be one of {MODES}, got {self.mode!r}.")
        if not isinstance(self.mask, int) or not 0 <= self.mask < 1 << MASK_BITS:
            raise ValueError(f"segment mask must be an integer in [0, {(1 << MASK_BITS) - 1}], got {self.mask!r}.")
        if self.mask and self.mode != "segments":
            raise ValueError(f"a segment mask applies to mode 'segments' only, not {self.mode!r}.")
        if not isinstance(self.offload, (int, float)) or not 0.0 <= self.offload <= 1.0:
            raise ValueError(f"offload ratio must be a number in [0, 1], got {self.offload!r}.")

    @classmethod
    def parse(cls, text: str) -> UnitPolicy:
        """``"none"``, ``"full"``, ``"selective"``, ``"segments:0101100"`` (boundary 0 first), each with an
        optional ``"@ratio"`` offload suffix, e.g. ``"full@0.5"``."""
        spec, _, ratio = text.strip().partition("@")
        mode, _, bits = spec.partition(":")
        mask = 0
        if mode == "segments":
            from slidedp_lightning.models.segments import parse_mask

            if not bits:
                raise ValueError(
                    f"segments need a mask of {MASK_BITS} '0'/'1' characters (boundary 0 first), "
                    f"e.g. 'segments:0101100'; got {text!r}."
                )
            try:
                kept = parse_mask(bits)
            except ValueError as err:
                raise ValueError(
                    f"{err} in activation policy {text!r}: write e.g. 'segments:0101100' (boundary 0 "
                    "first, 1 = keep the activations there)."
                ) from None
            mask = sum(1 << i for i, k in enumerate(kept) if k)
        elif bits:
            raise ValueError(f"only 'segments' takes a mask; got {text!r}.")
        try:
            offload = float(ratio) if ratio else 0.0
        except ValueError:
            raise ValueError(f"offload ratio after '@' must be a number in [0, 1]; got {text!r}.") from None
        try:
            return cls(mode, mask, offload)
        except ValueError as err:
            raise ValueError(
                f"{err} (in activation policy {text!r}; e.g. 'full', 'selective@0.5', 'segments:0101100@1')"
            ) from None

    def __str__(self) -> str:
        text = self.mode
        if self.mode == "segments":
            text += ":" + "".join("1" if self.mask >> i & 1 else "0" for i in range(MASK_BITS))
        return text + (f"@{self.offload:g}" if self.offload else "")


@dataclass(frozen=True)
class ActivationPolicy:
    """A default :class:`UnitPolicy` for every decoder block, and overrides by unit name (``"layers.3"``)."""

    default: UnitPolicy = UnitPolicy()
    units: dict[str, UnitPolicy] = field(default_factory=dict)

    def for_unit(self, name: str) -> UnitPolicy:
        return self.units.get(name, self.default)

    def to_dict(self) -> dict:
        return {"default": str(self.default), "units": {k: str(v) for k, v in sorted(self.units.items())}}

    @classmethod
    def from_dict(cls, data: dict) -> ActivationPolicy:
        try:
            default = UnitPolicy.parse(data.get("default", "none"))
            units = {k: UnitPolicy.parse(v) for k, v in data.get("units", {}).items()}
        except AttributeError:
            raise ValueError(
                f"an activation policy is {{'default': str, 'units': {{name: str}}}}; got {data!r}"
            ) from None
        return cls(default, units)

    @classmethod
    def coerce(cls, value) -> ActivationPolicy:
        """From an ActivationPolicy, a UnitPolicy, a mode string (``"full@0.5"``) or a policy JSON path."""
        if value is None:
            return cls()
        if isinstance(value, ActivationPolicy):
            return value
        if isinstance(value, UnitPolicy):
            return cls(value)
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)) and str(value).endswith(".json"):
            if not os.path.exists(value):
                raise FileNotFoundError(f"activation policy file {value} does not exist.")
            with open(value) as f:
                data = json.load(f)
            return cls.from_dict(data.get("activations", data))
        if isinstance(value, str):
            return cls(UnitPolicy.parse(value))
        raise TypeError(
            f"activation_policy must be a mode string, a UnitPolicy, an ActivationPolicy or a .json "
            f"path; got {type(value).__name__}."
        )
