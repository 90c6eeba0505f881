"""`meshc import-hf` on hostile model directories, config.json files and flags.

Every case is one line on stderr naming the file and field (or the flag) and what was expected, and
no file written: exit 2 for a config.json that is not a model description at all (unreadable, not an
object, a field missing or of the wrong JSON type or range) and for bad flags; exit 1, as for every
model meshllm cannot reproduce, for a well-formed value the families or the checker cannot honour.
A directory's name never becomes spec syntax.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from meshllm_dsl.checker import check_file, check_text
from meshllm_dsl.cli.main import main
from meshllm_dsl.front.limits import MAX_BLOCKS, MAX_INT
from meshllm_dsl.front.load import load
from meshllm_dsl.front.parser import parse_source
from meshllm_dsl.front.source import SourceFile

# What transformers writes for tiny Llama and GPT-2 models (the fields import-hf reads).
LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "rope_scaling": None, "head_dim": 8, "hidden_act": "silu",
    "max_position_embeddings": 128, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "torch_dtype": "float32",
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
GPT2: dict[str, Any] = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 67, "n_embd": 32, "n_layer": 4,
    "n_head": 4, "n_inner": None, "n_positions": 32, "layer_norm_epsilon": 1e-05,
    "activation_function": "gelu_new", "scale_attn_weights": True, "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
DROP = object()  # the field is left out of config.json
# Phi-3.5 / Phi-4-mini style: longrope under the old `type` key, no factor (transformers derives
# max_position_embeddings / original_max_position_embeddings), the trained length at the top level.
PHI3: dict[str, Any] = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 256,
                        "original_max_position_embeddings": 16}
PHI3_ROPE = {"type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0], "long_factor": [1.0, 2.0, 4.0, 8.0]}


def meshc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _config(base: dict[str, Any], **change: Any) -> str:
    cfg = {**base, **change}
    return json.dumps({k: v for k, v in cfg.items() if v is not DROP})


def _raw(text: str | bytes) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        (d / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    return write


def _llama(**change: Any) -> Callable[[Path], None]:
    return _raw(_config(LLAMA, **change))


def _gpt2(**change: Any) -> Callable[[Path], None]:
    return _raw(_config(GPT2, **change))


def _symlink_loop(d: Path) -> None:
    (d / "config.json").symlink_to(d / "config.json")


def _dangling(d: Path) -> None:
    (d / "config.json").symlink_to(d / "nowhere.json")


def _directory(d: Path) -> None:
    (d / "config.json").mkdir()


def _fifo(d: Path) -> None:
    os.mkfifo(d / "config.json")  # reading it would block forever


def _device(d: Path) -> None:
    (d / "config.json").symlink_to("/dev/zero")  # reading it would never end


def _no_config(d: Path) -> None:
    pass


POSITIVE_INT = "expected a positive integer (at most 1,099,511,627,776)"
# (id, what the directory holds, exit code, what the one line says besides the config.json path)
CASES: list[tuple[str, Callable[[Path], None], int, tuple[str, ...]]] = [
    # config.json is not a JSON object
    ("no-config", _no_config, 2, ("no such file", "Hugging Face model directory")),
    ("list", _raw("[1, 2]"), 2, ("holds [1, 2] (a list); expected a JSON object",)),
    ("string", _raw('"LlamaForCausalLM"'), 2, ("(a string); expected a JSON object",)),
    ("null", _raw("null"), 2, ("holds null; expected a JSON object",)),
    ("number", _raw("3"), 2, ("holds 3 (an integer); expected a JSON object",)),
    ("empty", _raw(""), 2, ("not valid JSON",)),
    ("truncated", _raw('{"vocab_size": 64,'), 2, ("not valid JSON",)),
    ("not-utf8", _raw(b'{"model_type": "\xff"}'), 2, ("not UTF-8 text (byte 16)",)),
    ("nested-too-deep", _raw("[" * 100_000), 2, ("nested too deeply",)),
    ("5000-digit-int", _raw('{"vocab_size": 1' + "0" * 5000 + "}"), 2, ("not valid JSON", "digits")),
    ("directory", _directory, 2, ("is a directory; expected a JSON file",)),
    ("symlink-loop", _symlink_loop, 2, ("cannot read it", "symbolic links")),
    ("dangling-link", _dangling, 2, ("no such file",)),
    ("fifo", _fifo, 2, ("is not a regular file",)),
    ("device", _device, 2, ("is not a regular file",)),
    # the architecture
    ("architectures-object", _llama(architectures={"a": 1}), 2, ("`architectures` is {\"a\": 1} (an object)",
                                                                  'expected a list of class names')),
    ("architectures-string", _llama(architectures="LlamaForCausalLM"), 2, ("`architectures` is", "(a string)")),
    ("architectures-of-ints", _llama(architectures=[1]), 2, ("`architectures` is [1] (a list)",)),
    ("model_type-list", _llama(architectures=DROP, model_type=["llama"]), 2, ("`model_type` is", "expected a string")),
    ("architecture-unknown", _llama(architectures=["FalconForCausalLM"]), 1, ("'FalconForCausalLM' is not supported",)),
    # integers: JSON integers, positive, within limits.py
    ("vocab-missing", _llama(vocab_size=DROP), 2, ("no `vocab_size`", POSITIVE_INT)),
    ("vocab-null", _llama(vocab_size=None), 2, ("no `vocab_size`", POSITIVE_INT)),
    ("heads-missing", _llama(num_attention_heads=DROP), 2, ("no `num_attention_heads`", POSITIVE_INT)),
    ("heads-zero", _llama(num_attention_heads=0), 2, ("`num_attention_heads` is 0 (an integer)", POSITIVE_INT)),
    ("hidden-fraction", _llama(hidden_size=64.5), 2, ("`hidden_size` is 64.5 (a number)", POSITIVE_INT)),
    # transformers keeps 64.0 a float and torch refuses a float size: refused like any other float
    ("hidden-integral-float", _llama(hidden_size=64.0), 2, ("`hidden_size` is 64.0 (a number)", POSITIVE_INT)),
    ("layers-fraction", _llama(num_hidden_layers=2.7), 2, ("`num_hidden_layers` is 2.7 (a number)",)),
    ("layers-true", _llama(num_hidden_layers=True), 2, ("`num_hidden_layers` is true (true or false)",)),
    ("layers-string", _llama(num_hidden_layers="4"), 2, ('`num_hidden_layers` is "4" (a string)',)),
    ("layers-negative", _llama(num_hidden_layers=-4), 2, ("`num_hidden_layers` is -4",)),
    ("layers-over-limit", _llama(num_hidden_layers=MAX_BLOCKS + 1), 2, ("`num_hidden_layers` is 100001",
                                                                         "at most 100,000")),
    ("vocab-over-limit", _llama(vocab_size=MAX_INT + 1), 2, ("`vocab_size` is 1099511627777", POSITIVE_INT)),
    ("ffn-list", _llama(intermediate_size=[64]), 2, ("`intermediate_size` is [64] (a list)",)),
    ("kv-heads-fraction", _llama(num_key_value_heads=2.5), 2, ("`num_key_value_heads` is 2.5",)),
    ("head-dim-zero", _llama(head_dim=0), 2, ("`head_dim` is 0",)),
    ("positions-string", _llama(max_position_embeddings="128"), 2, ("`max_position_embeddings` is \"128\"",)),
    ("hidden-below-heads", _llama(head_dim=None, hidden_size=2), 2, ("`hidden_size` 2 is smaller than "
                                                                     "`num_attention_heads` 4",)),
    ("kv-heads-not-dividing", _llama(num_key_value_heads=3), 1, ("does not check", "E0302",
                                                                 "kv_heads = `num_key_value_heads` 3")),
    # booleans: JSON booleans (the string "false" is truthy)
    ("tie-string-false", _llama(tie_word_embeddings="false"), 2, ('`tie_word_embeddings` is "false" (a string)',
                                                                  "expected true or false")),
    ("tie-zero", _llama(tie_word_embeddings=0), 2, ("`tie_word_embeddings` is 0 (an integer)",)),
    ("mlp-bias-string", _llama(mlp_bias="false"), 2, ("`mlp_bias` is \"false\"",)),
    ("attention-bias-null-is-default", _llama(attention_bias=None, vocab_size=None), 2, ("no `vocab_size`",)),
    # numbers: finite and positive; the checker's ranges for the rest
    ("eps-nan", _raw(_config(LLAMA).replace("1e-06", "NaN")), 2, ("`rms_norm_eps` is NaN", "a positive number")),
    ("eps-infinity", _raw(_config(LLAMA).replace("1e-06", "Infinity")), 2, ("`rms_norm_eps` is Infinity",)),
    ("eps-underflows-to-zero", _raw(_config(LLAMA).replace("1e-06", "1e-400")), 2, ("`rms_norm_eps` is 0.0",)),
    ("eps-negative", _llama(rms_norm_eps=-1e-6), 2, ("`rms_norm_eps` is -1e-06",)),
    ("eps-string", _llama(rms_norm_eps="1e-6"), 2, ('`rms_norm_eps` is "1e-6" (a string)', "a positive number")),
    ("eps-above-checker-range", _llama(rms_norm_eps=5.0), 1, ("`rms_norm_eps` = 5.0", "must be > 0 and <= 1",
                                                               "E0307")),
    ("theta-above-checker-range", _llama(rope_theta=1e300), 1, ("`rope_theta` = 1e+300", "<= 1e+12", "E0307")),
    ("theta-bool", _llama(rope_theta=True), 2, ("`rope_theta` is true",)),
    # rope scaling
    ("rope-scaling-string", _llama(rope_scaling="llama3"), 2, ('`rope_scaling` is "llama3" (a string)',
                                                               "expected an object (or null)")),
    ("rope-scaling-list", _llama(rope_scaling=[8.0]), 2, ("`rope_scaling` is [8.0] (a list)",)),
    ("rope-scaling-no-factor", _llama(rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}), 2,
     ("no `rope_scaling.factor`; expected a positive number",)),
    ("rope-scaling-no-original", _llama(rope_scaling={k: v for k, v in LLAMA3_ROPE.items()
                                                      if k != "original_max_position_embeddings"}), 2,
     ("no `rope_scaling.original_max_position_embeddings`", POSITIVE_INT)),
    ("rope-scaling-factor-string", _llama(rope_scaling={**LLAMA3_ROPE, "factor": "8"}), 2,
     ('`rope_scaling.factor` is "8" (a string)',)),
    ("rope-scaling-original-float", _llama(rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 16.5}), 2,
     ("`rope_scaling.original_max_position_embeddings` is 16.5",)),
    ("rope-scaling-type-int", _llama(rope_scaling={**LLAMA3_ROPE, "rope_type": 3}), 2,
     ("`rope_scaling.rope_type` is 3 (an integer); expected a string",)),
    ("rope-scaling-proportional", _llama(rope_scaling={"rope_type": "proportional", "factor": 4.0}), 1,
     ("rope scaling type 'proportional' is not supported",)),
    ("rope-scaling-yarn-mscale", _llama(rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7}), 1,
     ("`rope_scaling.mscale` = 0.7 changes yarn's attention factor",)),
    ("rope-scaling-yarn-no-factor", _llama(rope_scaling={"rope_type": "yarn"}), 2,
     ("`rope_scaling.factor`",)),
    # Phi-3's longrope: head_dim 8, so 4 factors of each kind
    ("phi3-longrope-short-length", _llama(**PHI3, rope_scaling={**PHI3_ROPE, "short_factor": [1.0] * 3}), 2,
     ("`rope_scaling.short_factor` has 3 numbers; expected 4 (head_dim 8 / 2",)),
    ("phi3-longrope-item-string", _llama(**PHI3, rope_scaling={**PHI3_ROPE, "long_factor": [1.0, "2", 1.0, 1.0]}), 2,
     ('`rope_scaling.long_factor` item 1 is "2" (a string); expected a positive number',)),
    ("phi3-longrope-item-zero", _llama(**PHI3, rope_scaling={**PHI3_ROPE, "long_factor": [1.0, 0.0, 1.0, 1.0]}), 2,
     ("`rope_scaling.long_factor` item 1 is 0.0",)),
    ("phi3-longrope-not-a-list", _llama(**PHI3, rope_scaling={**PHI3_ROPE, "short_factor": 1.0}), 2,
     ("`rope_scaling.short_factor` is 1.0", "expected a list of 4 positive numbers")),
    ("phi3-longrope-no-long-factor", _llama(**PHI3, rope_scaling={**PHI3_ROPE, "long_factor": None}), 2,
     ("no `rope_scaling.long_factor`",)),
    ("phi3-rope-linear", _llama(**PHI3, rope_scaling={"rope_type": "linear", "factor": 2.0}), 1,
     ("`rope_scaling.rope_type` = 'linear'; Phi-3's config takes longrope only",)),
    ("phi3-longrope-partial-rotary", _llama(**PHI3, partial_rotary_factor=0.75, rope_scaling=PHI3_ROPE), 1,
     ("`partial_rotary_factor` = 0.75 rotates only part of each head",)),
    ("rope-scaling-low-equals-high", _llama(rope_scaling={**LLAMA3_ROPE, "low_freq_factor": 4.0}), 1,
     ("does not check", "rope_high_freq_factor > rope_low_freq_factor", "`rope_scaling.low_freq_factor` 4.0")),
    ("rope-parameters-per-layer-type", _llama(rope_parameters={"full_attention": LLAMA3_ROPE}), 1,
     ("`rope_parameters.full_attention` is a rope per layer type",)),
    ("rope-parameters-list", _llama(rope_parameters=[1]), 2, ("`rope_parameters` is [1] (a list)",)),
    ("rope-original-twice", _llama(rope_scaling=LLAMA3_ROPE, original_max_position_embeddings=32), 1,
     ("`original_max_position_embeddings` 32 and `rope_scaling.original_max_position_embeddings` 16 disagree",)),
    ("layer-types-sliding", _llama(architectures=["Qwen2ForCausalLM"], layer_types=["full_attention"] * 3
                                   + ["sliding_attention"]), 1, ("`layer_types` holds 'sliding_attention'",)),
    ("layer-types-string", _llama(layer_types="full_attention"), 2, ('`layer_types` is "full_attention" (a string)',)),
    ("partial-rotary", _llama(partial_rotary_factor=0.5), 1, ("`partial_rotary_factor` = 0.5 rotates only part",)),
    # text fields
    ("dtype-number", _llama(torch_dtype=16), 2, ("`torch_dtype` is 16 (an integer); expected a string",)),
    ("dtype-unknown", _llama(torch_dtype="int8"), 1, ("`torch_dtype` = 'int8' is not a dtype",
                                                      "float32")),
    ("act-list", _llama(hidden_act=["silu"]), 2, ('`hidden_act` is ["silu"] (a list); expected a string',)),
    ("act-gelu", _llama(hidden_act="gelu"), 1, ("`hidden_act` = 'gelu'",)),
    ("softcap-string", _llama(final_logit_softcapping="30"), 2, ('`final_logit_softcapping` is "30"',
                                                                 "a number (or null)")),
    ("softcap-set", _llama(final_logit_softcapping=30.0), 1, ("`final_logit_softcapping` = 30.0 changes the logits",)),
    ("mistral-window-string", _llama(architectures=["MistralForCausalLM"], sliding_window="4096"), 2,
     ('`sliding_window` is "4096" (a string)',)),
    ("qwen2-window-flag-string", _llama(architectures=["Qwen2ForCausalLM"], use_sliding_window="no"), 2,
     ('`use_sliding_window` is "no" (a string); expected true or false',)),
    # GPT-2's fields
    ("gpt2-n-embd-fraction", _gpt2(n_embd=32.5), 2, ("`n_embd` is 32.5",)),
    ("gpt2-n-inner-zero", _gpt2(n_inner=0), 2, ("`n_inner` is 0",)),
    ("gpt2-positions-missing", _gpt2(n_positions=DROP), 2, ("no `n_positions`",)),
    ("gpt2-eps-nan", _raw(_config(GPT2).replace("1e-05", "NaN")), 2, ("`layer_norm_epsilon` is NaN",)),
    ("gpt2-scale-string", _gpt2(scale_attn_weights="true"), 2, ('`scale_attn_weights` is "true" (a string)',)),
    ("gpt2-tie-string", _gpt2(tie_word_embeddings="false"), 2, ('`tie_word_embeddings` is "false"',)),
    ("gpt2-cross-attention", _gpt2(add_cross_attention=True), 1, ("`add_cross_attention` = True adds cross-attention",)),
]


@pytest.mark.parametrize(("write", "code", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_config(tmp_path: Path, write: Callable[[Path], None], code: int, says: tuple[str, ...]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    write(model)
    out = tmp_path / "out.mesh"
    got, _, err = meshc("import-hf", str(model), "-o", str(out))
    assert got == code, err
    (line,) = err.splitlines()  # one line, no traceback
    assert line.startswith(f"meshc: error: {model / 'config.json'}: "), line
    for part in says:
        assert part in line, line
    assert not out.exists()


@pytest.mark.parametrize("base", [
    LLAMA, {**LLAMA, "rope_scaling": LLAMA3_ROPE, "original_max_position_embeddings": 16},
    {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "layer_types": ["full_attention"] * 4}, GPT2,
    {**LLAMA, **PHI3, "rope_scaling": PHI3_ROPE},
], ids=["llama", "llama3", "qwen2", "gpt2", "phi3-longrope"])
def test_the_base_configs_import(tmp_path: Path, base: dict[str, Any]) -> None:
    """The table's configs are valid: each case above fails for its one change."""
    (tmp_path / "config.json").write_text(json.dumps(base))
    code, _, err = meshc("import-hf", str(tmp_path), "-o", str(tmp_path / "m.mesh"), "--batch", "2", "--seq", "8")
    assert code == 0 and err == "", err
    assert check_file(tmp_path / "m.mesh").ok


def _imported(tmp_path: Path, cfg: dict[str, Any], name: str = "model", *flags: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / f"{len(list(tmp_path.iterdir()))}.mesh"
    code, _, err = meshc("import-hf", str(d), "-o", str(out), "--batch", "2", "--seq", "8", *flags)
    assert code == 0, err
    return out.read_text()


def _without_the_names(text: str) -> str:
    """The spec after its two comment lines, with the model's name (from the directory) as NAME."""
    (name,) = check_text(text, "imported.mesh").models
    body = text.split("\n", 2)[2]
    for before, after in ((f"model {name} =", "model NAME ="), (f"mesh {name}_mesh ", "mesh NAME_mesh "),
                          (f" on {name}_mesh for {name} ", " on NAME_mesh for NAME ")):
        assert body.count(before) == 1, (before, body)
        body = body.replace(before, after)
    return body


@pytest.mark.parametrize("change", [
    {"head_dim": None}, {"rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_theta": DROP},
    {"num_key_value_heads": None, "num_attention_heads": 2}, {"sliding_window": None}, {"torch_dtype": DROP},
], ids=["head_dim", "rope-default", "rope-parameters", "kv-heads", "window", "dtype"])
def test_null_and_default_mean_the_default(tmp_path: Path, change: dict[str, Any]) -> None:
    """transformers reads null as the default, and rope type "default" as no scaling."""
    explicit = {**LLAMA, **{k: v for k, v in change.items() if v is not DROP and v is not None}}
    if "num_key_value_heads" in change:
        explicit["num_key_value_heads"] = 2
    if change.get("torch_dtype") is DROP:
        explicit["torch_dtype"] = "float32"
    if "rope_scaling" in change or "rope_parameters" in change:
        explicit.pop("rope_scaling"), explicit.pop("rope_parameters", None)
    got = _imported(tmp_path, json.loads(_config(LLAMA, **change)), "defaulted")
    assert _without_the_names(got) == _without_the_names(_imported(tmp_path, explicit, "explicit"))


# Each would end the generated comment and start a line of spec if it were written as text.
HOSTILE_DIRS = ['x"\ninclude "families.mesh"', "a}\nmesh evil {", "a\rplan evil on m for m {", "m\u2028include \"x.mesh\"",
                "'; include \"families.mesh\"", "$(touch INJECTED)", "class", "9lives", "__init__", "x" * 200,
                "é模型", os.fsdecode(b"bad\xffbyte"), "suggested", "suggested_mesh", "-rf"]


@pytest.mark.parametrize("name", HOSTILE_DIRS)
def test_a_directory_name_never_becomes_spec_syntax(tmp_path: Path, name: str) -> None:
    # A families.mesh next to the output that would break (and name) any spec that included it.
    (tmp_path / "families.mesh").write_text("model evil = llama { vocab = 0 }\n")
    (tmp_path / "x.mesh").write_text("model evil = llama { vocab = 0 }\n")
    plain = _imported(tmp_path, LLAMA, "plain")
    text = _imported(tmp_path, LLAMA, name)
    out = tmp_path / "spec.mesh"
    out.write_text(text)
    result = check_file(out)
    assert result.ok, [d.message for d in result.diagnostics]
    items = parse_source(SourceFile(str(out), text)).items
    assert sorted(type(d).__name__ for d in items) == ["MeshDecl", "ModelDecl", "PlanDecl"]  # no include
    assert len(load(str(out)).sources) == 1  # nothing read but the spec itself
    (model,) = result.models.values()
    assert "evil" not in result.models and model.name.isidentifier() and len(model.name) <= 59
    # Only the comment and the name differ from the same model in a plainly named directory.
    assert _without_the_names(text) == _without_the_names(plain)
    assert text.count("\n") == plain.count("\n")
    assert check_text(text, str(out)).plans["train"].model.name == model.name


@pytest.mark.parametrize(("flags", "says"), [
    (["--batch", "0"], "--batch must be a positive integer"),
    (["--seq", "0"], "--seq must be a positive integer"),
    (["--batch", "-8"], "--batch must be a positive integer"),
    (["--devices", "0"], "--devices must be a positive integer"),
    (["--devices", str(2**17 + 1)], "--devices must be a positive integer (at most 131,072), got 131073"),
    (["--seq", str(MAX_INT + 1)], "--seq must be a positive integer (at most 1,099,511,627,776)"),
    (["--batch", "x"], "--batch: invalid int value"),
    (["--device", "tpu9"], "unknown device `tpu9`"),
], ids=["batch-0", "seq-0", "batch-negative", "devices-0", "devices-over-limit", "seq-over-limit", "batch-text",
        "device-unknown"])
def test_bad_flags_name_the_flag(tmp_path: Path, flags: list[str], says: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    out = tmp_path / "m.mesh"
    code, _, err = meshc("import-hf", str(tmp_path), "-o", str(out), *flags)
    # argparse's refusals come after its usage lines, as for every command
    (line,) = [ln for ln in err.splitlines() if not ln.startswith(("usage:", " "))]
    assert code == 2 and says in line, err
    assert not out.exists()


def test_a_gpt2_sequence_longer_than_its_positions_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    code, _, err = meshc("import-hf", str(tmp_path), "-o", str(tmp_path / "m.mesh"), "--seq", "33")
    assert code == 2 and "--seq 33 is longer than the 32 positions" in err and "n_positions" in err, err
    assert not (tmp_path / "m.mesh").exists()


def test_a_plan_that_cannot_fit_is_written_with_the_planners_warning(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    out = tmp_path / "m.mesh"
    code, _, err = meshc("import-hf", str(tmp_path), "-o", str(out), "--seq", str(10**12))
    assert code == 0, err
    assert err.startswith("warning[W0801]: plan `train` needs ") and f"{out}:" in err and "GiB" in err, err
    assert "Nothing fits the device's memory" in out.read_text()


def test_the_output_is_never_the_input_config(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    code, _, err = meshc("import-hf", str(tmp_path), "-o", str(config), "--force")
    assert code == 2 and "is the input" in err, err
    assert json.loads(config.read_text()) == LLAMA


@pytest.mark.parametrize(("change", "want"), [
    # Phi-3.5-mini / Phi-4-mini: `type`, the factor derived, the top-level trained length
    ({**PHI3, "rope_scaling": PHI3_ROPE}, {"rope_factor": 16.0, "rope_original_positions": 16}),
    # Phi-3-mini-128k's first configs said "su" (Phi3Config reads it as longrope), with a factor
    ({**PHI3, "rope_scaling": {**PHI3_ROPE, "type": "su", "factor": 2.0}}, {"rope_factor": 2.0}),
    # Phi3Config's own default trained length, 4096, when the config has none at the top level
    ({**PHI3, "max_position_embeddings": 8192, "original_max_position_embeddings": DROP, "rope_scaling": PHI3_ROPE},
     {"rope_factor": 2.0, "rope_original_positions": 4096}),
    # transformers 5's rope_parameters, with an attention factor; a Llama reads the rope object's length
    ({"rope_theta": DROP, "rope_parameters": {**PHI3_ROPE, "rope_type": "longrope", "rope_theta": 500.0,
      "original_max_position_embeddings": 32, "attention_factor": 1.5}},
     {"rope_factor": 4.0, "rope_original_positions": 32, "rope_attention_factor": 1.5, "rope_theta": 500.0}),
], ids=["phi35", "su", "phi3-default-original", "llama-rope-parameters"])
def test_longrope_imports_as_transformers_reads_it(tmp_path: Path, change: dict[str, Any], want: dict[str, Any]) -> None:
    from meshllm_dsl.interop.import_hf import model_settings

    cfg = json.loads(_config(LLAMA, **change))
    family, settings, _ = model_settings(cfg, "config.json")
    got = {k: v for k, v, _ in settings}
    assert family == "llama" and got["rope_type"] == "longrope"
    assert got["rope_short_factor"] == (1.0, 1.25, 1.5, 2.0) and got["rope_long_factor"] == (1.0, 2.0, 4.0, 8.0)
    assert {k: got.get(k) for k in want} == want
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = meshc("import-hf", str(tmp_path), "-o", str(tmp_path / "m.mesh"), "--batch", "2", "--seq", "8")
    assert code == 0 and err == "", err
    text = (tmp_path / "m.mesh").read_text()
    assert "rope_short_factor = [1.0, 1.25, 1.5, 2.0]" in text and check_file(tmp_path / "m.mesh").ok
