"""Datasheet numbers of the GPUs this project targets, as data.

Peaks are dense tensor-core FLOP/s (no 2:4 sparsity) of the SXM parts from NVIDIA's datasheets:
H100 SXM and H200 SXM share a Hopper GH100 die at the same clocks (they differ in HBM: 80 GB
HBM3 at 3.35 TB/s vs 141 GB HBM3e at 4.8 TB/s); Hopper has no FP4 tensor-core format. B200 (HGX,
1000 W) and GB200 (per GPU) from the Blackwell datasheets. NVLink is the per-GPU total
(both directions); one direction is half of it. `nvlink_domain` GPUs share one NVLink switch
fabric (an HGX board of 8; a GB200 NVL72 rack of 72); traffic between domains goes over the
scale-out network, one 400 Gb/s NIC per GPU (50 GB/s each way) on the reference systems.
"""

from __future__ import annotations

import dataclasses

TERA = 1e12


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float
    fp4_flops: float | None  # None: no FP4 tensor-core MMA
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, both directions together
    hbm_bytes: float
    num_sms: int
    nvlink_domain: int = 8
    scale_out_bytes_per_s: float = 50e9  # per GPU, one direction

    def peak(self, fmt: str) -> float | None:
        """Dense peak of the MMA format a kernel actually runs: "bf16", "fp8" or "fp4"."""
        peaks = {"bf16": self.bf16_flops, "fp8": self.fp8_flops, "fp4": self.fp4_flops}
        if fmt not in peaks:
            raise ValueError(f"unknown MMA format {fmt!r}; expected one of {sorted(peaks)}")
        return peaks[fmt]


DEVICES = {
    "H100": DeviceSpec("H100", 989.4 * TERA, 1978.9 * TERA, None, 3.35e12, 900e9, 80e9, 132),
    "H200": DeviceSpec("H200", 989.4 * TERA, 1978.9 * TERA, None, 4.8e12, 900e9, 141e9, 132),
    "B200": DeviceSpec("B200", 2250 * TERA, 4500 * TERA, 9000 * TERA, 8e12, 1.8e12, 180e9, 148),
    "GB200": DeviceSpec(
        "GB200", 2500 * TERA, 5000 * TERA, 10000 * TERA, 8e12, 1.8e12, 186e9, 148, 72
    ),
}


def spec_for(device_kind: str) -> DeviceSpec | None:
    """The spec whose name appears in a JAX `device_kind` ("NVIDIA H200", "NVIDIA GB200"...)."""
    kind = device_kind.upper()
    for name in sorted(DEVICES, key=len, reverse=True):  # GB200 before B200
        if name in kind:
            return DEVICES[name]
    return None


def by_name(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {sorted(DEVICES)}")
    return DEVICES[name]
