"""Energy counters for `asteria.train`: NVML on NVIDIA GPUs, RAPL where the host exposes it.

Owns: finding the counters this machine exposes and reading them as joules since ``start()``.
Must not: estimate anything: a missing, unreadable (RAPL is often root-only) or unsupported
source is reported with the reason, and the report says "not measured on this machine".
NVML: ``nvmlDeviceGetTotalEnergyConsumption`` per visible GPU (mJ since the driver loaded). RAPL:
every top-level ``/sys/class/powercap/intel-rapl:N/energy_uj`` (one per package, AMD too), in uJ,
wrapping at ``max_energy_range_uj`` (each read adds the forward difference modulo the range: the
loop reads every step). RAPL covers the whole package, NVML the whole GPU.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

POWERCAP = "/sys/class/powercap"


@dataclass
class _RaplDomain:
    path: str
    max_range_uj: int
    last_uj: int
    total_uj: int = 0


@dataclass
class EnergyMeter:
    """Cumulative joules per source since :meth:`start`; ``sources`` and ``unavailable`` say
    what is read and why anything is not."""

    sources: list[str] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    _rapl: list[_RaplDomain] = field(default_factory=list)
    _nvml_handles: list = field(default_factory=list)
    _nvml_start_mj: list[int] = field(default_factory=list)
    _pynvml: object = None

    @classmethod
    def probe(cls, powercap: str = POWERCAP, use_nvml: bool = True) -> EnergyMeter:
        meter = cls()
        meter._probe_rapl(powercap)
        if use_nvml:
            meter._probe_nvml()
        return meter

    # -- probing ---------------------------------------------------------------------------

    def _probe_rapl(self, powercap: str) -> None:
        zones = sorted(
            p for p in glob.glob(os.path.join(powercap, "intel-rapl:*")) if p.count(":") == 1
        )
        if not zones:
            self.unavailable["rapl"] = f"no {powercap}/intel-rapl:* zones on this host"
            return
        errors = []
        for zone in zones:
            try:
                max_range = int(_read(os.path.join(zone, "max_energy_range_uj")))
                now = int(_read(os.path.join(zone, "energy_uj")))
            except (OSError, ValueError) as err:
                errors.append(f"{zone}: {err.__class__.__name__}: {err}")
                continue
            self._rapl.append(_RaplDomain(zone, max(max_range, 1), now))
        if self._rapl:
            self.sources.append("rapl")
        else:
            self.unavailable["rapl"] = "; ".join(errors)

    def _probe_nvml(self) -> None:
        try:
            import pynvml
        except ImportError:
            self.unavailable["nvml"] = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible(count)]
            starts = [int(pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in handles]
        except Exception as err:  # NVMLError subclasses: no driver, no GPU, not supported
            self.unavailable["nvml"] = f"{err.__class__.__name__}: {err}"
            return
        if not handles:
            self.unavailable["nvml"] = "no NVIDIA GPU visible"
            return
        self._pynvml, self._nvml_handles, self._nvml_start_mj = pynvml, handles, starts
        self.sources.append("nvml")

    # -- reading ---------------------------------------------------------------------------

    @property
    def measured(self) -> bool:
        return bool(self.sources)

    def start(self) -> None:
        """Zero every counter (the run starts now)."""
        for d in self._rapl:
            d.total_uj = 0
            d.last_uj = int(_read(os.path.join(d.path, "energy_uj")))
        if self._pynvml is not None:
            self._nvml_start_mj = [
                int(self._pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._nvml_handles
            ]

    def read(self) -> dict[str, float]:
        """Joules per source since :meth:`start` (empty when nothing is measured)."""
        out: dict[str, float] = {}
        if self._rapl:
            for d in self._rapl:
                now = int(_read(os.path.join(d.path, "energy_uj")))
                d.total_uj += (now - d.last_uj) % d.max_range_uj  # forward, across a wrap
                d.last_uj = now
            out["rapl"] = sum(d.total_uj for d in self._rapl) / 1e6
        if self._pynvml is not None:
            now = [
                int(self._pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._nvml_handles
            ]
            out["nvml"] = sum(n - s for n, s in zip(now, self._nvml_start_mj)) / 1e3
        return out

    def describe(self) -> str:
        if self.measured:
            return ", ".join(self.sources)
        return (
            "not measured on this machine ("
            + "; ".join(f"{k}: {v}" for k, v in self.unavailable.items())
            + ")"
        )


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read().strip()


def _visible(count: int) -> list[int]:
    """NVML indices of the GPUs CUDA_VISIBLE_DEVICES leaves visible (all when unset; UUIDs and
    MIG names fall back to all)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count))
    try:
        ids = [int(x) for x in env.split(",") if x.strip()]
    except ValueError:
        return list(range(count))
    return [i for i in ids if 0 <= i < count]


def efficiency(vocab_size: int, final_loss: float, energy_j: float, adamw_energy_j: float) -> float:
    """The paper's figure: (ln(vocab) - final loss) / (energy / AdamW's energy)."""
    import math

    return (math.log(vocab_size) - final_loss) / (energy_j / adamw_energy_j)
