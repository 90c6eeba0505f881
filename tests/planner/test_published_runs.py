"""The planner against published training runs (../shared/calibration/published.md), the only
figures the device profiles and the time model's constants are fitted to (devices.A100_MATMUL,
H100_MATMUL, planner.ELEMENTWISE_PASSES): every row within 10 %.

Megatron-LM SC21 Table 1 reports model TFLOP/s per GPU counted as F = 96 B s l h^2 (1 + s / 6h +
V / 16 l h) per iteration, recomputation included, so its iteration time is F / (TFLOP/s x GPUs);
those runs predate fused (flash) attention, so they are planned with the softmax probabilities in
memory (`flash_attention=False`). torchtitan reports tokens per second per GPU (eager) and the
memory it logs per GPU; its op-level selective checkpointing is `recompute = ops` (the same policy:
attention outputs and every other matmul output kept).

Memory is compared, never fitted: no constant of the planner comes from those two figures. What
torchtitan logs is `reserved_bytes.all.peak` of torch.cuda.memory_stats (train.py at 9dec370, the
benchmark's commit, prints `max_reserved_gib`), i.e. what the caching allocator holds, while the
planner counts allocated tensors (torch.cuda.max_memory_allocated, what `meshc run --profile`
reports), at most what is reserved. Its peak is at the loss's backward: 32 blocks x 0.97 GiB kept
by the selective policy (block input, q, v, gate, down, attention out and log-sum-exp), the fp32
log-softmax (7.8 GiB) and its two gradients (15.7 GiB), FSDP2's gathered bf16 root (embedding and
head, 1.96 GiB, never resharded after forward) and blocks, and the sharded fp32 states (16 bytes per
parameter / N: 14.96 GiB at FSDP 8, 0.93 at FSDP 128); it adds one block's rerun and the head's
weight gradient to that moment as an upper bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm_dsl.cli.plan import load_checked
from meshllm_dsl.planner.analyze import analyze, resolve_device
from meshllm_dsl.planner.formatting import GIB
from meshllm_dsl.planner.records import PlanReport
from meshllm_dsl.planner.time import model_flops_per_token

HERE = Path(__file__).resolve().parent / "published"

# (spec, layers, hidden, GPUs, global batch, published TFLOP/s per GPU)
MEGATRON = [
    ("megatron_sc21_1p7b.mesh", 24, 2304, 32, 512, 137),
    ("megatron_sc21_3p6b.mesh", 30, 3072, 64, 512, 138),
    ("megatron_sc21_7p5b.mesh", 36, 4096, 128, 512, 142),
    ("megatron_sc21_18b.mesh", 40, 6144, 256, 1024, 135),
]
# (spec, GPUs, published tokens/s per GPU in eager mode, published memory per GPU in GiB)
TORCHTITAN = [
    ("torchtitan_llama3_8b_fsdp8.mesh", 8, 5762, 82.4),
    ("torchtitan_llama3_8b_fsdp128.mesh", 128, 5605, 67.0),
]
SEQ, VOCAB = 2048, 51200


def _report(name: str, flash_attention: bool = True) -> PlanReport:
    loaded = load_checked(str(HERE / name))
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    (plan,) = loaded.result.plans.values()
    device, _ = resolve_device(plan, loaded.devices)
    return analyze(plan, device, flash_attention=flash_attention)


def megatron_iteration_s(layers: int, hidden: int, gpus: int, batch: int, tflops: float) -> float:
    f = 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))
    return f / (tflops * 1e12 * gpus)


def rows() -> list[tuple[str, float, float]]:
    """(run, published, planned): Megatron's iteration seconds, torchtitan's tokens/s per GPU and
    its memory per GPU in GiB."""
    out = []
    for name, layers, hidden, gpus, batch, tflops in MEGATRON:
        rep = _report(name, flash_attention=False)
        out.append((name, megatron_iteration_s(layers, hidden, gpus, batch, tflops), rep.step.total_s))
    for name, gpus, tokens_s, _ in TORCHTITAN:
        rep = _report(name)
        out.append((name, tokens_s, rep.step.tokens / rep.step.total_s / gpus))
    for name, _, _, memory in TORCHTITAN:
        out.append((name.replace(".mesh", " GiB"), memory, _report(name).peak_training_bytes / GIB))
    return out


def test_published_runs_within_ten_percent(capsys: pytest.CaptureFixture[str]) -> None:
    table = rows()
    with capsys.disabled():
        print(f"\n{'run':36} {'published':>10} {'planned':>10} {'ratio':>6}")
        for name, published, planned in table:
            print(f"{name.removesuffix('.mesh'):36} {published:10.3f} {planned:10.3f} {planned / published:6.3f}")
    off = [(n, round(planned / published, 3)) for n, published, planned in table if abs(planned / published - 1) > 0.10]
    assert not off, off


def test_torchtitan_fsdp128_saves_the_states_fsdp8_keeps() -> None:
    # FSDP 128 shards the 16 bytes per parameter of states 16x finer than FSDP 8: 14.0 GiB of the
    # 15.4 GiB torchtitan logs between the two rows; the rest is the allocator's, not the plan's.
    (small, _, _, small_pub), (large, _, _, large_pub) = TORCHTITAN
    planned = _report(small).peak_training_bytes / GIB - _report(large).peak_training_bytes / GIB
    assert planned == pytest.approx(16 * 8_030_261_248 * (1 / 8 - 1 / 128) / GIB, rel=1e-3)
    assert planned == pytest.approx(small_pub - large_pub, rel=0.10)


def test_torchtitan_blocks_keep_what_its_selective_policy_keeps() -> None:
    # Per block and microbatch (2 x 8,192 tokens, bf16): the block's input, the outputs of its
    # 1st, 3rd, 5th and 7th products (q 4,096 wide, v 1,024, gate 14,336, down 4,096; k, o and up are
    # recomputed) and the attention kernel's output with its fp32 log-sum-exp per head: 994 MiB.
    # Outside the blocks: the token ids, the final norm's input and fp32 rstd, the head's input and
    # the fp32 log-softmax. (Keeping every product, as before, was 1,602 MiB a block.)
    r = _report("torchtitan_llama3_8b_fsdp8.mesh").ranks[0]
    t, e, h = 2 * 8192, 2, 4096
    block = e * t * (h + h + 1024 + h + 14336 + h) + 4 * t * 32
    assert block == 994 * 2**20
    top = 8 * t + (e * t * h + 4 * t) + e * t * h + 4 * t * 128256
    assert r.activation_bytes_per_microbatch == 32 * block + top


def test_standard_flops_per_token() -> None:
    # torchtitan's get_num_flop_per_token for Llama 3.1 8B at seq 8,192: 6 (N - N_emb) + 12 l h q t.
    rep = _report("torchtitan_llama3_8b_fsdp8.mesh")
    model, plan = rep.plan.model, rep.plan
    n_emb = 128256 * 4096
    norms = 4096 * (2 * 32 + 1)  # 6 N counts them, the planner does not (not matmuls)
    standard = 6 * (model.numel - n_emb - norms) + 12 * 32 * 32 * 128 * 8192
    assert model_flops_per_token(plan) == standard
    assert rep.step.model_flops == standard * plan.batch * plan.seq
    # Megatron's count without its recomputation: the tied logit layer is counted, biases and
    # norms are not.
    for name, layers, hidden, *_ in MEGATRON:
        plan = _report(name, flash_attention=False).plan
        # Per token: 96 -> 72 for the layers, whose recomputed forward it counts; the logit layer
        # (its V / 16 l h term, 6 V h per token) is not recomputed.
        megatron = 72 * layers * hidden**2 * (1 + SEQ / (6 * hidden)) + 6 * VOCAB * hidden
        assert model_flops_per_token(plan) == pytest.approx(megatron, rel=1e-12)
