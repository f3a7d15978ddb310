"""Hardware profiles: every constant with the source it came from.

A profile JSON maps each field to ``{"value": ..., "source": "..."}``. Sources start with ``paper:`` (a
number measured in arXiv 2609.34162), ``datasheet:``, ``probe:`` (measured on that machine: by ``calibrate``, or
by the named run), ``fitted:`` (fitted to a named paper figure or measured run; its source says what was held out)
or ``assumed:`` (no measurement exists).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCE_KINDS = ("paper:", "datasheet:", "probe:", "fitted:", "assumed:")
LINK_KINDS = ("none", "nvlink", "pcie", "host", "loopback")
GB = 1e9
REQUIRED = (
    "gpus",
    "gpu_flops",
    "gpu_efficiency",
    "bwd_fwd_ratio",
    "op_overhead_s",
    "step_overhead_s",
    "h2d_gbps",
    "d2h_gbps",
    "copy_latency_s",
    "link_kind",
    "link_gbps",
    "link_latency_s",
    "host_dram_gbps",
    "cpu_cores",
    "update_gbps",
    "host_is_device",
)
# The inter-host network (optional: a profile without it models one host). ``net_gbps``: GB/s per direction per
# host, shared by the host's ranks; ``net_latency_s``: latency of one step of a ring collective between hosts.
NETWORK_KEYS = ("net_gbps", "net_latency_s")
# Optional: ``colocated_cores`` says the "hosts" are process groups on this one machine (a calibrated profile whose
# network was probed over loopback): its N x R ranks share its DRAM and these cores (measured with all N x R ranks
# busy, in the units of the R-rank probes: ``cpu_cores`` x N on an otherwise idle machine).
COLOCATED_KEY = "colocated_cores"
# Optional, for a CPU "device" (``host_is_device``; each defaults to "not modelled"):
# ``fresh_gbps``: GB/s per rank of writing into a freshly allocated buffer of ``alloc_reuse_bytes`` or more (the
# allocator maps it anew from the kernel, so every page faults on first write); smaller buffers come back from the
# heap already mapped and copy at the copy rate. ``loop_overhead_s``: the training loop's time per step on the
# compute thread outside the runtime's traced work (the loop's Python, the training step, the loss and its
# logging), measured from the lane traces of a real run (``steptime loop``).
FRESH_KEYS = ("fresh_gbps", "alloc_reuse_bytes")
LOOP_KEY = "loop_overhead_s"
# Optional: ``loss_s_per_token``, the loss's seconds per token of a rank's batch on top of ``step_overhead_s``
# (its fixed part); a large vocabulary makes it grow with the batch.
LOSS_KEY = "loss_s_per_token"
# Optional: ``compute_precision``, the precision ``calibrate`` timed the compute in (a CPU "device" computes BF16 and
# FP32 at different rates); a step of another precision is refused rather than predicted from the wrong rate.
COMPUTE_PRECISION_KEY = "compute_precision"


@dataclass(frozen=True)
class Profile:
    """A machine: R GPUs (or CPU ranks), their links, and the host that serves them."""

    name: str
    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    description: str = ""

    def __getattr__(self, key: str) -> Any:
        values = self.__dict__.get("values", {})
        if key in values:
            return values[key]
        raise AttributeError(key)

    # -- derived rates -------------------------------------------------------------------------------
    def check_gpus(self, r: int) -> None:
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"gpus must be an integer >= 1, got {r!r}")
        if r > self.gpus:
            raise ValueError(f"profile {self.name!r} has {self.gpus} GPU(s); cannot model R={r}")

    @staticmethod
    def _concurrent(table: dict[str, float], k: int) -> float:
        """Per-GPU GB/s when ``k`` GPUs copy at once: the table's entry, or beyond it the largest entry's
        per-GPU rate (each further GPU pair sits behind its own switch)."""
        known = sorted(int(n) for n in table)
        below = [n for n in known if n <= k] or known[:1]
        return float(table[str(k)] if str(k) in table else table[str(max(below))])

    def h2d_per_gpu(self, k: int) -> float:
        return self._concurrent(self.h2d_gbps, k) * GB

    def d2h_per_gpu(self, k: int) -> float:
        return self._concurrent(self.d2h_gbps, k) * GB

    def update_rate(self, cores: int | None = None) -> float:
        """Host-wide CPU update bytes/s on ``cores`` cores (default: all): 1/rate = 1/(a c) + 1/B through the
        profile's points (saturation); one point means a flat rate."""
        cores = self.cpu_cores if cores is None else cores
        pts = sorted((int(c), float(v)) for c, v in self.update_gbps.items())
        if len(pts) == 1:
            return pts[0][1] * GB
        (c1, v1), (c2, v2) = pts[0], pts[-1]
        inv_a = (1 / v1 - 1 / v2) / (1 / c1 - 1 / c2)  # = 1/a
        inv_b = 1 / v2 - inv_a / c2
        if inv_b <= 0:  # no saturation visible between the points: linear in cores
            return v1 / c1 * cores * GB
        return GB / (inv_a / cores + inv_b)

    def check_hosts(self, hosts: int) -> None:
        if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
            raise ValueError(f"hosts must be an integer >= 1, got {hosts!r}")
        if hosts > 1:
            missing = [k for k in NETWORK_KEYS if k not in self.values]
            if missing:
                raise ValueError(
                    f"profile {self.name!r} has no inter-host network ({', '.join(missing)}); give "
                    f"--network (one of {shipped_networks()}) or add the constants"
                )
            if not self.net_gbps > 0 or self.net_latency_s < 0:
                raise ValueError(f"profile {self.name!r}: net_gbps must be > 0 and net_latency_s >= 0")

    @property
    def loop_overhead(self) -> float:
        """Seconds per step of the training loop outside the runtime's traced work (0 when not measured)."""
        return float(self.values.get(LOOP_KEY, 0.0))

    def loss_seconds(self, tokens: float) -> float:
        """The loss of a rank's ``tokens`` (fixed part + per token)."""
        return self.step_overhead_s + float(self.values.get(LOSS_KEY, 0.0)) * tokens

    def fresh_bytes(self, nbytes: float) -> float:
        """Bytes of a per-use buffer of ``nbytes`` that are written into fresh pages (0 when the allocator reuses
        buffers of that size, or when the profile does not model fresh allocations)."""
        if not self.host_is_device or "fresh_gbps" not in self.values:
            return 0.0
        return nbytes if nbytes >= self.alloc_reuse_bytes else 0.0

    @property
    def colocated(self) -> bool:
        """The profile's hosts share one machine (see ``COLOCATED_KEY``)."""
        return COLOCATED_KEY in self.values

    def capacities(self, r: int, hosts: int = 1) -> dict[str, float]:
        """Per-rank service capacity of each resource when all ``r`` ranks of each of ``hosts`` hosts run the same
        step at once (every host has its own CPU, DRAM and PCIe; its ``r`` ranks share its network bandwidth).

        Co-located hosts (``colocated_cores``): the machine's DRAM and its measured cores serve all ``r x hosts``
        ranks; every other rate is a rank's own (measured with ``r`` ranks at once), shared through the cores."""
        self.check_gpus(r)
        self.check_hosts(hosts)
        colocated = hosts > 1 and self.colocated
        cap = {
            "gpu": self.gpu_flops * self.gpu_efficiency,
            "h2d": self.h2d_per_gpu(r),
            "d2h": self.d2h_per_gpu(r),
            "link": self.link_gbps * GB if self.link_gbps else math.inf,
            "cpu": self.update_rate() / r,
            "dram": self.host_dram_gbps * GB / (r * hosts if colocated else r),
            # one process updating alone on its 1/R share of the cores (the paper's baseline: rank 0 runs Adam)
            "updater": self.update_rate(max(1, self.cpu_cores // r)),
        }
        if self.host_is_device:
            cap["cores"] = (self.colocated_cores / (r * hosts)) if colocated else self.cpu_cores / r
        if "fresh_gbps" in self.values:
            cap["fresh"] = self.fresh_gbps * GB
        if hosts > 1:
            cap["net"] = self.net_gbps * GB / r
        if "disk_gbps" in self.values:  # the state file's disk, shared by the host's ranks (co-located: all)
            cap["disk"] = self.disk_gbps * GB / (r * hosts if colocated else r)
        return cap

    def with_network(self, name_or_path: str | Path) -> Profile:
        """This profile with its inter-host network replaced by a shipped network (:func:`shipped_networks`) or
        a JSON file of ``{"net_gbps": {"value", "source"}, "net_latency_s": {...}}``."""
        net = load_network(name_or_path)
        values, sources = dict(self.values), dict(self.sources)
        values.pop(COLOCATED_KEY, None)  # a network between machines: each host has its own
        sources.pop(COLOCATED_KEY, None)
        for key in NETWORK_KEYS:
            values[key], sources[key] = net["constants"][key]["value"], net["constants"][key]["source"]
        return Profile(f"{self.name}+{net['name']}", values, sources, f"{self.description}; {net['description']}")

    # -- io --------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "constants": {k: {"value": v, "source": self.sources.get(k, "")} for k, v in self.values.items()},
        }

    @classmethod
    def from_json(cls, data: dict, where: str = "profile") -> Profile:
        consts = data.get("constants")
        if not isinstance(consts, dict):
            raise ValueError(f"{where}: no 'constants' mapping")
        missing = [k for k in REQUIRED if k not in consts]
        if missing:
            raise ValueError(f"{where}: missing constants {missing}")
        values, sources = {}, {}
        for key, entry in consts.items():
            if not isinstance(entry, dict) or "value" not in entry:
                raise ValueError(f"{where}: constant {key!r} must be {{'value': ..., 'source': ...}}")
            src = str(entry.get("source", ""))
            if not src.startswith(SOURCE_KINDS):
                raise ValueError(
                    f"{where}: constant {key!r} has source {src!r}; it must start with one of {SOURCE_KINDS}"
                )
            values[key], sources[key] = entry["value"], src
        partial = [k for k in NETWORK_KEYS if k in values]
        if partial and len(partial) != len(NETWORK_KEYS):
            raise ValueError(f"{where}: the inter-host network needs all of {NETWORK_KEYS}, got only {partial}")
        cores = values.get(COLOCATED_KEY)
        if COLOCATED_KEY in values and (
            isinstance(cores, bool) or not isinstance(cores, (int, float)) or cores <= 0 or "net_gbps" not in values
        ):
            raise ValueError(
                f"{where}: {COLOCATED_KEY} must be a number > 0 with the network constants, got "
                f"{values[COLOCATED_KEY]!r}"
            )
        partial = [k for k in FRESH_KEYS if k in values]
        if partial and len(partial) != len(FRESH_KEYS):
            raise ValueError(f"{where}: fresh allocations need all of {FRESH_KEYS}, got only {partial}")
        for key in (*partial, *[k for k in (LOOP_KEY, LOSS_KEY) if k in values]):
            v = values[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (key == "fresh_gbps" and v == 0):
                raise ValueError(
                    f"{where}: {key} must be a number {'> 0' if key == 'fresh_gbps' else '>= 0'}, got {v!r}"
                )
        if values["link_kind"] not in LINK_KINDS:
            raise ValueError(f"{where}: link_kind {values['link_kind']!r} not in {LINK_KINDS}")
        return cls(str(data.get("name", where)), values, sources, str(data.get("description", "")))


# beside this file (not ``importlib.resources``, which would import the package and so the library: the command
# line loads this module by file, see slidedp_lightning_cli/task.py)
SHIPPED_PROFILES = Path(__file__).with_name("profiles")


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    return sorted(p.name[:-5] for p in SHIPPED_PROFILES.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (see :func:`shipped_profiles`) or a profile JSON file (from ``calibrate``)."""
    key = str(name_or_path)
    if key in shipped_profiles():
        text = (SHIPPED_PROFILES / f"{key}.json").read_text()
        return Profile.from_json(json.loads(text), key)
    path = Path(key)
    if path.suffix == ".json" and path.is_file():
        return Profile.from_json(json.loads(path.read_text()), str(path))
    raise ValueError(
        f"unknown hardware profile {key!r}: give one of {shipped_profiles()} or a profile JSON file "
        "(python -m slidedp_lightning.steptime calibrate writes one)"
    )


# Shipped inter-host networks (``--network``): per-host bandwidth per direction and per-step latency, sourced.
NETWORKS: dict[str, dict] = {
    "ib_ndr400x8": {
        "description": "8x 400 Gb/s NDR InfiniBand per host (one NIC per GPU, DGX H100 style)",
        "constants": {
            "net_gbps": {
                "value": 400.0,
                "source": "datasheet: NDR InfiniBand 400 Gb/s = 50 GB/s per direction "
                "per port; DGX H100 has 8 ConnectX-7 ports for the compute "
                "fabric (line rate; protocol efficiency not modelled)",
            },
            "net_latency_s": {
                "value": 5e-06,
                "source": "assumed: ~5 us per collective step (NDR switch + HCA ~1-2 us, plus NCCL protocol)",
            },
        },
    },
    "ib_hdr200x4": {
        "description": "4x 200 Gb/s HDR InfiniBand per host",
        "constants": {
            "net_gbps": {
                "value": 100.0,
                "source": "datasheet: HDR InfiniBand 200 Gb/s = 25 GB/s per direction "
                "per port; assumed: 4 ports per 8-GPU host (line rate)",
            },
            "net_latency_s": {
                "value": 5e-06,
                "source": "assumed: ~5 us per collective step (HDR switch + HCA ~1-2 us, plus NCCL protocol)",
            },
        },
    },
    "ib_ndr400": {
        "description": "one 400 Gb/s NDR InfiniBand port per host",
        "constants": {
            "net_gbps": {
                "value": 50.0,
                "source": "datasheet: NDR InfiniBand 400 Gb/s = 50 GB/s per direction (line rate)",
            },
            "net_latency_s": {
                "value": 5e-06,
                "source": "assumed: ~5 us per collective step (switch + HCA ~1-2 us, plus NCCL protocol)",
            },
        },
    },
    "roce100": {
        "description": "one 100 Gb/s RoCE port per host",
        "constants": {
            "net_gbps": {"value": 12.5, "source": "datasheet: 100 GbE = 12.5 GB/s per direction (line rate)"},
            "net_latency_s": {
                "value": 1e-05,
                "source": "assumed: ~10 us per collective step (RoCE v2 through an "
                "Ethernet switch, plus NCCL protocol)",
            },
        },
    },
    "eth25": {
        "description": "one 25 GbE port per host (TCP sockets)",
        "constants": {
            "net_gbps": {"value": 3.125, "source": "datasheet: 25 GbE = 3.125 GB/s per direction (line rate)"},
            "net_latency_s": {
                "value": 3e-05,
                "source": "assumed: ~30 us per collective step (TCP through the kernel and a switch)",
            },
        },
    },
}


def _networks() -> dict:
    return NETWORKS


def shipped_networks() -> list[str]:
    """Names of the inter-host networks shipped with the package (``NETWORKS``)."""
    return sorted(_networks())


def load_network(name_or_path: str | Path) -> dict:
    """A shipped network by name or a network JSON file: ``{"name", "description", "constants": {net_gbps,
    net_latency_s}}``, every constant with a source."""
    key = str(name_or_path)
    nets = _networks()
    if key in nets:
        data = {"name": key, **nets[key]}
    elif Path(key).suffix == ".json" and Path(key).is_file():
        data = json.loads(Path(key).read_text())
        data.setdefault("name", Path(key).stem)
    else:
        raise ValueError(f"unknown network {key!r}: give one of {shipped_networks()} or a network JSON file")
    consts = data.get("constants", {})
    for k in NETWORK_KEYS:
        entry = consts.get(k)
        if not isinstance(entry, dict) or "value" not in entry:
            raise ValueError(f"network {key!r}: constant {k!r} must be {{'value': ..., 'source': ...}}")
        if not str(entry.get("source", "")).startswith(SOURCE_KINDS):
            raise ValueError(f"network {key!r}: constant {k!r} needs a source starting with one of {SOURCE_KINDS}")
    if not consts["net_gbps"]["value"] > 0 or consts["net_latency_s"]["value"] < 0:
        raise ValueError(f"network {key!r}: net_gbps must be > 0 and net_latency_s >= 0")
    data.setdefault("description", "")
    return data
