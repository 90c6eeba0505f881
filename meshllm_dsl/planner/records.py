"""What the planner reports of a plan (planner.analyze): per rank class (pipeline coordinate) what
each device holds and the collectives it runs, the step's time by part, and the whole report with
its peaks, fit and MFU. Records only: the analysis computes them (planner/analyze.py's STEPS, in
memory.py, comm.py and time.py), report.py and the views print them."""

from __future__ import annotations

from typing import Any

import attrs

from meshllm_dsl.ir import PlanIR
from meshllm_dsl.parallel.collectives import WirePrimitive
from meshllm_dsl.parallel.devices import DeviceProfile


@attrs.frozen
class Comm:
    """One kind of collective a device runs, summed over a training step."""

    axis: str  # mesh axis (or axes, joined by " x ") it runs over
    kind: str  # tensor | pipeline | data | tied | loss | context
    op: WirePrimitive
    calls: int  # collective calls per step
    payload_bytes: int  # sum of the tensors' sizes handed to the collective
    wire_bytes: int  # bytes each device sends (ring algorithm)
    seconds: float
    crosses_hosts: bool


@attrs.frozen
class RankClass:
    """Every device at one pipeline coordinate: what each of them holds and does in a step."""

    coord: int
    stages: tuple[int, ...]
    label: str  # layers held
    ranks: tuple[int, ...]
    params_global: int  # parameters of the stages (tied copies counted where they live)
    params_local: int  # parameters one device holds after tensor sharding (before ZeRO)
    params_replicated: int  # of which replicated over the sharding axes (norms, row biases, ...)
    weight_bytes: int  # after ZeRO-3
    grad_bytes: int  # after ZeRO-2
    optimizer_bytes: int  # after ZeRO-1
    gather_buffer_bytes: int  # ZeRO 2 / 3 (FSDP2): the compute-dtype copy all-gathered at the peak
    activation_bytes_per_microbatch: int
    in_flight: int  # microbatches (chunk forwards when interleaved) whose activations are held at the peak
    activation_bytes: int
    # Beyond the saved activations, at the step's peak: stage outputs the pipeline schedule keeps
    # until their backward (logits on the last stage) and the backward working set of one unit.
    transient_bytes: int
    kv_cache_bytes: int  # inference at the plan's batch and seq
    comms: tuple[Comm, ...]
    compute_s: float  # recomputation included
    dtype_bytes: int  # bytes per weight in the training dtype
    recompute_s: float = 0.0  # of compute_s: the forward passes `recompute` runs again in backward
    kernels: int = 0  # framework kernels per step (forward, backward, gradient sync, optimizer)
    kernel_s: float = 0.0  # of compute_s: their host time (`kernel` of the device; 0 when not given)
    host_s: float = 0.0  # time the rank occupies its host core: compute_s plus its collectives' host time
    # Pipelined ZeRO 2 / 3: FSDP2's unsharded gradients accumulated between microbatches, at the peak.
    grad_accum_bytes: int = 0

    @property
    def training_bytes(self) -> int:
        return (self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.gather_buffer_bytes
                + self.activation_bytes + self.transient_bytes + self.grad_accum_bytes)

    @property
    def inference_bytes(self) -> int:
        # Inference keeps the weights in the training dtype and no optimizer: weights + KV cache.
        return self.params_local_bytes + self.kv_cache_bytes

    @property
    def params_local_bytes(self) -> int:
        return self.params_local * self.dtype_bytes

    def comm_seconds(self, kinds: tuple[str, ...]) -> float:
        return sum(c.seconds for c in self.comms if c.kind in kinds)


@attrs.frozen
class StepTime:
    compute_s: float  # slowest rank's compute
    tensor_s: float  # its exposed tensor-parallel communication
    pipeline_s: float  # its pipeline send / recv (and tied-weight sync)
    bubble_s: float
    data_s: float  # data-parallel gradient reduction / ZeRO collectives (after the pipeline drains)
    model_flops: float  # the standard count: model_flops_per_token x tokens
    tokens: int
    # Ranks time-sharing fewer cores (a device with `cores`): the host's work over its cores, a lower
    # bound on the step however the ranks wait for each other; 0 when every rank has its own device.
    shared_s: float = 0.0
    expert_s: float = 0.0  # its expert-parallel all-to-alls (moe layers' token dispatch and combine)
    # Context parallelism's K / V all-gathers and dK / dV reduce-scatters: exposed, the runtime waits
    # for each gather before its attention runs (no ring to overlap with the compute).
    context_s: float = 0.0

    @property
    def critical_s(self) -> float:
        """The step with a device per rank: the slowest rank's work, stretched by the bubble."""
        return self.compute_s + self.tensor_s + self.expert_s + self.pipeline_s + self.bubble_s + self.data_s + self.context_s

    @property
    def total_s(self) -> float:
        return max(self.critical_s, self.shared_s)

    @property
    def comm_s(self) -> float:
        return self.tensor_s + self.expert_s + self.pipeline_s + self.data_s + self.context_s


@attrs.frozen
class PlanReport:
    plan: PlanIR
    device: DeviceProfile
    device_assumed: bool  # the mesh names no device: the default profile was used
    micro_batch: int  # sequences per microbatch per data replica
    bubble: float
    ranks: tuple[RankClass, ...]
    step: StepTime
    kv_bytes_per_token: int  # whole model, one sequence position
    optimizer_k: int
    hosts_assumed: bool = False  # the mesh has no `hosts` and more devices than one host holds (W0708)
    flash_attention: bool = True  # priced with a fused attention kernel (what a re-pricing of the plan keeps)

    @property
    def peak_training_bytes(self) -> int:
        """The most bytes of tensors any rank holds at once in a step: what
        torch.cuda.max_memory_allocated reports (and `meshc run --profile` prints), not the caching
        allocator's reserved memory, which is at least as much (torchtitan logs that one)."""
        return max(r.training_bytes for r in self.ranks)

    @property
    def peak_inference_bytes(self) -> int:
        return max(r.inference_bytes for r in self.ranks)

    @property
    def fits(self) -> bool:
        return self.peak_training_bytes <= self.device.memory_bytes

    @property
    def fits_inference(self) -> bool:
        return self.peak_inference_bytes <= self.device.memory_bytes

    @property
    def mfu(self) -> float:
        """Model flops utilisation of the whole estimated step (what a profiler would report)."""
        peak = self.plan.mesh.devices * self.device.tflops * 1e12
        return self.step.model_flops / (self.step.total_s * peak) if self.step.total_s else 0.0

    def comm_by_axis(self) -> list[dict[str, Any]]:
        """Per mesh axis and kind: bytes and seconds per step on the busiest rank class."""
        rows: dict[tuple[str, str, str], dict[str, Any]] = {}
        for rc in self.ranks:
            for c in rc.comms:
                key = (c.axis, c.kind, c.op)
                row = rows.get(key)
                if row is None or c.seconds > row["seconds"]:
                    rows[key] = {"axis": c.axis, "kind": c.kind, "op": c.op, "calls": c.calls,
                                 "payload_bytes": c.payload_bytes, "wire_bytes": c.wire_bytes,
                                 "seconds": c.seconds, "crosses_hosts": c.crosses_hosts, "pipeline_coord": rc.coord}
        return sorted(rows.values(), key=lambda r: -r["seconds"])
