"""Device profiles the planner knows: memory, dense throughput and link bandwidths.

Figures are vendor datasheet numbers (dense, no sparsity); links are per-direction bandwidth.
A .mesh file can declare its own with `device NAME { memory = 80, tflops = 989, ... }`.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class DeviceProfile:
    name: str
    memory_gib: float  # usable accelerator memory
    tflops: float  # peak dense bf16/fp16 TFLOP/s
    intra_gbps: float  # GB/s between devices of one host (NVLink)
    inter_gbps: float  # GB/s between hosts (network, per device)


PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("a100_40gb", 40.0, 312.0, 300.0, 25.0),
        DeviceProfile("a100", 80.0, 312.0, 300.0, 25.0),
        DeviceProfile("a100_80gb", 80.0, 312.0, 300.0, 25.0),
        DeviceProfile("h100", 80.0, 989.0, 450.0, 50.0),
        DeviceProfile("h200", 141.0, 989.0, 450.0, 50.0),
        DeviceProfile("cpu", 16.0, 1.0, 10.0, 1.0),
    )
}
