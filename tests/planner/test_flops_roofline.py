"""The compute model: standard FLOPs per kind (lookups are memory traffic, not matmuls), a
roofline per matmul with wave quantization, and collectives per algorithm and link."""

from __future__ import annotations

import attrs
import pytest

from meshllm_dsl.checker import check_text
from meshllm_dsl.parallel.costs import Matmul, matmul_seconds
from meshllm_dsl.parallel.devices import PROFILES
from meshllm_dsl.planner.analyze import analyze
from meshllm_dsl.planner.comm import _link
from meshllm_dsl.planner.time import ELEMENTWISE_PASSES

EMBED_ALONE = """
mesh m { axes pipeline = 3
    device = h100 }
model l = llama { vocab = 128256, hidden = 4096, layers = 8, heads = 32, kv_heads = 8, ffn = 14336 }
plan p on m for l {
    batch = 8
    seq = 4096
    microbatches = 8
    stages over pipeline { 0: embed  1: blocks[0:4]  2: blocks[4:8], norm, lm_head }
    schedule 1f1b
}
"""


def _plan(text: str):  # type: ignore[no-untyped-def]
    result = check_text(text, "t.mesh")
    assert result.ok, [d.message for d in result.diagnostics]
    (plan,) = result.plans.values()
    return plan


def test_a_stage_of_only_the_embedding_is_not_the_slowest() -> None:
    # 525M parameters in the table: as 6 x params it took longer than four blocks' worth of
    # matmuls; as a lookup it is the rows read and written.
    rep = analyze(_plan(EMBED_ALONE), PROFILES["h100"])
    embed, first, last = rep.ranks
    assert embed.compute_s < 0.01 * first.compute_s
    hbm = PROFILES["h100"].hbm_gbps * 1e9
    lookup = 2 * 2 * 8 * 4096 * 4096  # rows read, output written, bf16, every token of the step
    ids = ELEMENTWISE_PASSES * 8 * 8 * 4096  # what it saves: the int64 token ids
    states = 2 * (embed.weight_bytes + embed.grad_bytes + embed.optimizer_bytes)  # the optimizer step
    assert embed.compute_s == pytest.approx((3 * (lookup + ids) + states) / hbm)
    assert rep.step.compute_s == max(first.compute_s, last.compute_s)


def test_roofline_and_waves() -> None:
    a100 = attrs.evolve(PROFILES["a100"], mfu=1.0)
    peak, hbm = 312e12, 2039e9
    big = Matmul(108 * 128, 8192, 8192)  # 108 x 64 tiles: 64 full waves
    assert matmul_seconds(a100, big, 2) == pytest.approx(big.flops / peak)
    # One 128 x 128 tile: one SM of 108 works, the others wait.
    tile = Matmul(128, 128, 65536)
    assert matmul_seconds(a100, tile, 2) == pytest.approx(tile.flops / (peak / 108))
    # A matrix-vector product is bound by memory: its operands and result read and written once.
    thin = Matmul(1, 8192, 8192, count=108)
    assert matmul_seconds(a100, thin, 2) == pytest.approx(2 * 108 * (8192 + 8192 * 8192 + 8192) / hbm)


DATA = """
mesh m {{ axes {axes}
    hosts = 4
    device = a100 }}
model l = llama {{ vocab = 32000, hidden = 1024, layers = 2, heads = 8, ffn = 2816 }}
plan p on m for l {{
    batch = 32
    seq = 512
    layout {{ batch -> data{tensor} }}
}}
"""


def test_collective_bandwidth_per_algorithm_and_link() -> None:
    a100 = PROFILES["a100"]
    # In a host: NVLink at NCCL-tests' ring efficiency.
    inside = _plan(DATA.format(axes="data = 8", tensor="").replace("hosts = 4", "hosts = 1"))
    bw, lat, crosses = _link(inside, a100, ("data",), "all_reduce")
    assert not crosses and bw == pytest.approx(0.70 * 300e9) and lat == pytest.approx(14 * 10e-6 / 14)
    # Across 4 hosts with 8 members in each: a ring per NIC, 8 x 24 GB/s (DGX A100's 192 GB/s).
    wide = _plan(DATA.format(axes="data = 32", tensor=""))
    bw, _, crosses = _link(wide, a100, ("data",), "all_reduce")
    assert crosses and bw == pytest.approx(8 * 24e9)
    # One member per host (tensor 8 inside each): one NIC.
    thin = _plan(DATA.format(axes="data = 4, tensor = 8", tensor="").replace(
        "layout { batch -> data }", "layout { batch -> data, heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }"))
    bw, lat, crosses = _link(thin, a100, ("data",), "all_reduce")
    assert crosses and bw == pytest.approx(24e9) and lat == pytest.approx(2 * 3 * 25e-6 / 14)
    # H100's all-reduce in a host uses NVLink SHARP (480 GB/s), its all-gather the ring (370).
    h100 = PROFILES["h100"]
    assert _link(inside, h100, ("data",), "all_reduce")[0] == pytest.approx(1.07 * 450e9)
    assert _link(inside, h100, ("data",), "all_gather")[0] == pytest.approx(0.82 * 450e9)


def test_h200_is_h100_compute_with_more_and_faster_memory() -> None:
    h100, h200 = PROFILES["h100"], PROFILES["h200"]
    assert (h200.tflops, h200.mfu, h200.sms, h200.intra_gbps, h200.bus_efficiency) == \
        (h100.tflops, h100.mfu, h100.sms, h100.intra_gbps, h100.bus_efficiency)
    assert (h200.memory_gib, h200.hbm_gbps) == (141.0, 4800.0)
    big, thin = Matmul(132 * 128, 8192, 8192), Matmul(8, 8192, 8192)
    assert matmul_seconds(h200, big, 2) == matmul_seconds(h100, big, 2)  # compute-bound: the same
    assert matmul_seconds(h200, thin, 2) == pytest.approx(matmul_seconds(h100, thin, 2) * 3350 / 4800)
