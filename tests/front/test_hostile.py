"""Hostile input: specs a careless user or an attacker writes. None may crash, hang or exhaust memory;
each must produce its located diagnostic. The rendered output of every case is a golden under
tests/front/hostile/ (rewrite with `pytest tests/front --update-goldens` and review the diff).

The cases run `meshc check` (its main, one case after another) in one child process limited to
1 GiB of address space, each case under a 10 s alarm, so a regression (a hang, a size-linear loop,
unbounded memory) fails one case instead of the suite; one child instead of one per case saves its
start-up (about 0.4 s) on each of them.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "hostile"
LIMIT_S = 10
LIMIT_BYTES = 1 << 30

MESH = "mesh m {\n    axes data = 1\n}\n"
LLAMA = "model t = llama {{\n    vocab = 256\n    hidden = 32\n    layers = {layers}\n    heads = 4\n    ffn = 64{extra}\n}}\n"
PLAN = "plan p on m for t {{\n{body}}}\n"


def _spec(body: str = "", layers: str = "2", extra: str = "", mesh: str = MESH) -> str:
    return mesh + LLAMA.format(layers=layers, extra=extra) + PLAN.format(body=body)


# name -> (spec text, codes that must appear)
CASES: dict[str, tuple[str, set[str]]] = {
    "lr_overflows": (_spec("    optimizer adamw { lr = 1e999 }\n"), {"E0307"}),
    "lr_underflows": (_spec("    optimizer adamw { lr = 1e-999 }\n"), {"E0307"}),
    "rope_theta_nan": (_spec(extra="\n    rope_theta = nan"), {"E0304"}),
    # Lists (longrope's factors): a list where one value goes, items that are not numbers, a wrong length
    "list_in_plan": (_spec("    batch = [4, 4]\n"), {"E0304"}),
    "list_as_dim": (_spec(layers="[2]"), {"E0304"}),
    "list_as_number": (_spec(extra="\n    norm_eps = [1e-6]"), {"E0304"}),
    "list_item_string": (_spec(extra='\n    rope_type = longrope\n    rope_short_factor = [1.0, "x", 1.0, 1.0]'
                                     "\n    rope_long_factor = [1.0, 1.0, 1.0, 1.0]"), {"E0304"}),
    "list_item_zero": (_spec(extra="\n    rope_type = longrope\n    rope_short_factor = [1.0, 1.0, 0.0, 1.0]"
                                   "\n    rope_long_factor = [1.0, 1.0, 1.0, 1.0]"), {"E0307"}),
    "list_wrong_length": (_spec(extra="\n    rope_type = longrope\n    rope_short_factor = [1.0, 1.0, 1.0, 1.0]"
                                      "\n    rope_long_factor = [1.0, 1.0,\n        1.0]"), {"E0304"}),
    "list_20k_items": (_spec(extra="\n    rope_type = longrope\n    rope_short_factor = [1.0, 1.0, 1.0, 1.0]"
                                    "\n    rope_long_factor = [" + "1.0, " * 20_000 + "]"), {"E0304"}),
    "longrope_without_factors": (_spec(extra="\n    rope_type = longrope"), {"E0304"}),
    "factors_without_longrope": (_spec(extra="\n    rope_short_factor = [1.0, 1.0, 1.0, 1.0]"), {"E0304"}),
    "norm_eps_zero": (_spec(extra="\n    norm_eps = 0"), {"E0307"}),
    "beta1_negative": (_spec("    optimizer adamw { beta1 = -5 }\n"), {"E0307"}),
    "beta2_one": (_spec("    optimizer adamw { beta2 = 1 }\n"), {"E0307"}),
    "axis_10_pow_40": (_spec(mesh="mesh m {\n    axes data = " + "1" + "0" * 40 + "\n}\n"), {"E0307"}),
    "axis_product_too_large": (_spec(mesh="mesh m {\n    axes a = 65536, b = 65536\n}\n"), {"E0307"}),
    "axis_computed_huge": (_spec(mesh="mesh m {\n    axes data = " + " * ".join(["1000000"] * 20) + "\n}\n"), {"E0307"}),
    "layers_10_pow_40": (_spec(layers="1" + "0" * 40), {"E0307"}),
    "layers_too_many": (_spec(layers="10000000"), {"E0307"}),
    "int_5000_digits": (_spec(layers="7" * 5000), {"E0307"}),
    "sum_of_1000_terms": (_spec(layers=" + ".join(["1"] * 1000)), {"E0311"}),
    "minus_1000_times": (_spec(layers="-" * 1000 + "2"), {"E0311"}),
    "parens_1000_deep": (_spec(layers="(" * 1000 + "2" + ")" * 1000), set()),
    "zero_4": (_spec("    optimizer adamw { zero 4 }\n"), {"E0203"}),
    "precision_without_zero": (_spec("    precision { params = bf16, master = fp32, reduce = bf16 }\n"), {"E0309"}),
    "precision_bad_settings": (_spec("    layout { batch -> data }\n    dtype = fp16\n"
                                     "    precision { params = bf16, mastr = fp32, reduce = int8, params = fp32 }\n"
                                     "    precision { master = fp16 }\n    optimizer adamw { zero 3 }\n"), {"E0203", "E0201"}),
    "precision_master_narrower": (_spec("    layout { batch -> data }\n    precision { params = fp32, master = bf16 }\n"
                                        "    optimizer adamw { zero 2 }\n"), {"E0203"}),
    "zero_twice": (_spec("    optimizer adamw { zero 1 zero 1 }\n"), {"E0201"}),
    "seed_in_plan": (_spec("    seed = 1\n"), {"E0309"}),
    "lr_in_plan": (_spec("    lr = 0.1\n"), {"E0309"}),
    "adam": (_spec("    optimizer adam\n"), {"E0309"}),
    "loss_twice": (_spec("    loss cross_entropy\n    loss cross_entropy\n"), {"E0201"}),
    "opt_setting_twice": (_spec("    optimizer adamw { lr = 0.1 lr = 0.2 }\n"), {"E0201"}),
    "plan_setting_twice": (_spec("    seq = 8\n    seq = 16\n"), {"E0201"}),
    "model_setting_twice": (_spec(extra="\n    ffn = 128"), {"E0201"}),
    "mesh_setting_twice": (_spec(mesh="mesh m {\n    axes data = 1\n    hosts = 1\n    hosts = 1\n}\n"), {"E0201"}),
    "microbatches_zero": (_spec("    microbatches = 0\n"), {"E0303"}),
    "plan_named_torch": (MESH + LLAMA.format(layers="2", extra="") + "plan torch on m for t {\n}\n", {"E0204"}),
    "plan_named_os": (MESH + LLAMA.format(layers="2", extra="") + "plan os on m for t {\n}\n", {"E0204"}),
    "plan_name_300_chars": (MESH + LLAMA.format(layers="2", extra="") + "plan " + "p" * 300 + " on m for t {\n}\n",
                            {"E0204"}),
    "layer_named_params": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                           "    params = rmsnorm(hidden)\n    head = linear(hidden, 16)\n}\n", {"E0204"}),
    "layer_named_self": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                         "    self = rmsnorm(hidden)\n    head = linear(hidden, 16)\n}\n", {"E0204"}),
    "layer_named_underscore": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                               "    _modules = rmsnorm(hidden)\n    head = linear(hidden, 16)\n}\n", {"E0204"}),
    "head_wrong_vocab": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                         "    head = linear(hidden, 12)\n}\n", {"E0308"}),
    "head_wrong_width": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                         "    head = linear(4, 16)\n}\n", {"E0308"}),
    "block_without_norm": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                           "    blocks = repeat(2) {\n        attn = attention(hidden, 2)\n    }\n"
                           "    head = linear(hidden, 16)\n}\n", {"E0308"}),
    "attention_outside_repeat": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                                 "    attn = attention(hidden, 2)\n    head = linear(hidden, 16)\n}\n", {"E0309"}),
    "gpt2_seq_past_positions": (MESH + "model t = gpt2 {\n    hidden = 32\n    layers = 2\n    heads = 4\n"
                                "    positions = 16\n}\n" + PLAN.format(body="    seq = 17\n"), {"E0310"}),
    "tied_head_with_bias": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                            "    head = linear(hidden, 16, tie = embed, bias = true)\n}\n", {"E0309"}),
    "family_parameter_twice": ("family f(a, a = 2) {\n    e = embedding(16, a)\n    h = linear(a, 16)\n}\n", {"E0201"}),
    "layernorm_without_bias": (MESH + "model t {\n    hidden = 8\n    embed = embedding(16, hidden)\n"
                               "    norm = layernorm(hidden, bias = false)\n    head = linear(hidden, 16)\n}\n", set()),
    "device_memory_zero": ("device d {\n    like = h100\n    memory = 0\n}\n" + _spec(), {"E0303"}),
    "device_per_host_fraction": ("device d {\n    like = h100\n    per_host = 2.5\n}\n" + _spec(), {"E0304"}),
    "device_cores_zero": ("device d {\n    like = cpu\n    cores = 0\n}\n" + _spec(), {"E0303"}),
    "device_cores_huge": ("device d {\n    like = cpu\n    cores = 1e12\n}\n" + _spec(), {"E0307"}),
    "device_kernel_negative": ("device d {\n    like = cpu\n    kernel = -8\n}\n" + _spec(), {"E0303"}),
    "device_collective_cpu_named": ("device d {\n    like = cpu\n    collective_cpu = fast\n}\n" + _spec(), {"E0304"}),
    "device_mfu_above_one": ("device d {\n    like = h100\n    mfu = 1.5\n}\n" + _spec(), {"E0307"}),
}


def _limits() -> None:  # runs in the child, before exec
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


# In the child: `meshc check NAME.mesh` from each case's directory, its stderr + stdout and exit code
# (None with the traceback appended if it raised, SIGALRM past LIMIT_S included), as JSON on stdout.
DRIVER = f"""
import contextlib, io, json, os, signal, sys, traceback
from meshllm_dsl.cli.main import main

def past_the_limit(*_):
    raise TimeoutError("past {LIMIT_S} s")

signal.signal(signal.SIGALRM, past_the_limit)
results = {{}}
for case_dir in sys.argv[1:]:
    name = os.path.basename(case_dir)
    os.chdir(case_dir)
    err, out = io.StringIO(), io.StringIO()
    signal.alarm({LIMIT_S})
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(["check", name + ".mesh"])
    except BaseException:
        code = None
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
    results[name] = [code, err.getvalue() + out.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int | None, str]]:
    """Every case's (exit code, rendered output), from one limited child."""
    import json

    root = tmp_path_factory.mktemp("hostile")
    for name, (text, _) in CASES.items():
        (root / name).mkdir()
        (root / name / f"{name}.mesh").write_text(text)
    proc = subprocess.run(
        [sys.executable, "-P", "-c", DRIVER, *(str(root / name) for name in sorted(CASES))],
        capture_output=True, text=True, timeout=LIMIT_S * len(CASES), preexec_fn=_limits,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: (code, rendered) for name, (code, rendered) in json.loads(proc.stdout).items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_case(
    name: str, checked: dict[str, tuple[int | None, str]], request: pytest.FixtureRequest
) -> None:
    _, codes = CASES[name]
    returncode, rendered = checked[name]
    assert "Traceback" not in rendered and "MemoryError" not in rendered, rendered[-2000:]
    for code in codes:
        assert f"[{code}]" in rendered, rendered[-2000:]
    assert returncode == (1 if any(c.startswith("E") for c in codes) else 0), rendered[-2000:]
    for block in rendered.split("\n\n"):
        if block.startswith(("error[", "warning[")):
            assert " --> " in block and "^" in block and "= help: " in block, block[:2000]
    golden = HERE / f"{name}.expected"
    if request.config.getoption("--update-goldens"):
        golden.write_text(rendered)
    assert golden.exists(), f"missing golden {golden.name}: run pytest --update-goldens"
    assert rendered == golden.read_text()


def test_no_orphan_hostile_goldens() -> None:
    orphans = sorted(p.stem for p in HERE.glob("*.expected") if p.stem not in CASES)
    assert not orphans, orphans


# The largest spec the limits admit: every tool finishes, bounded in time and memory.
LARGEST = """\
mesh m {
    axes data = 2048, tensor = 64
}
model t = llama {
    vocab = 32768
    hidden = 8192
    layers = 100000
    heads = 64
    ffn = 28672
}
plan p on m for t {
    batch = 2048
    layout { batch -> data, heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
}
"""


@pytest.mark.parametrize(("command", "limit_s"), [("check", LIMIT_S), ("plan", LIMIT_S), ("explain", 60)])
def test_largest_admitted_spec_is_bounded(command: str, limit_s: int, tmp_path: Path) -> None:
    # explain lists each of the 131,072 ranks (about 3 CPU-seconds); its limit leaves room for a loaded machine.
    path = tmp_path / "largest.mesh"
    path.write_text(LARGEST)
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "meshllm_dsl", command, path.name],
        cwd=tmp_path, capture_output=True, text=True, timeout=limit_s, preexec_fn=_limits,
    )
    assert proc.returncode == 0, (proc.stderr + proc.stdout)[-2000:]
    assert "Traceback" not in proc.stderr
