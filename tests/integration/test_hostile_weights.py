"""Hostile `--weights` and `--export-hf` directories (issue 21 items 1, 3, 4, 7, 9): one line each.

Each case mutates a copy of a tiny real Llama saved by transformers (tests/hf_models.py) and calls
the checks `meshc run` and every rank make before anything starts (`hf.check_weights`,
`hf.check_export_dir`), in-process: they only read files.  A few cases go end to end through
`meshc run`'s main (exit 2, nothing launched) and through an export on the worker pool.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from hf_models import build_hf, export_job, spec, word_tokenizer  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.codegen.emit import render_plan  # noqa: E402
from meshllm_dsl.runtime.hf import weights as hf  # noqa: E402
from meshllm_dsl.runtime.jobs.pool import WorkerPool  # noqa: E402
from meshllm_dsl.runtime.outputs import MANIFEST  # noqa: E402
from meshllm_dsl.verify.equivalence import load_generated  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    build_hf("llama", root / "llama")
    word_tokenizer(root / "llama" / "tok", ["a", "b"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(root / "llama" / "tok" / name, root / "llama" / name)
    (root / "llama" / "tok").rmdir()
    return root / "llama"


@pytest.fixture(scope="module")
def plan_module(tmp_path_factory: pytest.TempPathFactory) -> str:
    text = spec("llama", "single")
    result = check_text(text, "llama.mesh")
    assert result.ok
    (p,) = result.plans.values()
    path = tmp_path_factory.mktemp("plan") / "llama_single.py"
    path.write_text(render_plan(p, "llama.mesh", text))
    return str(path)


@pytest.fixture(scope="module")
def program(plan_module: str) -> Any:
    return load_generated(plan_module).PROGRAM


# ---------------------------------------------------------------- mutations of a good model


def _config(d: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _raw_config(data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / "config.json").write_bytes(data)


def _config_dir(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").mkdir()


def _config_loop(d: Path) -> None:
    (d / "config.json").unlink()
    os.symlink("loop.json", d / "config.json")
    os.symlink("config.json", d / "loop.json")


def _config_outside(d: Path) -> None:
    secret = d.parent / f"{d.name}-secret.json"
    secret.write_text((d / "config.json").read_text())
    (d / "config.json").unlink()
    os.symlink(secret, d / "config.json")


def _tensors(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        state = st.load_file(str(d / "model.safetensors"))
        change(state)
        st.save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return go


def _third_layer(state: dict[str, Any]) -> None:  # a fifth block for a 4-block model
    for key in [k for k in state if k.startswith("model.layers.3.")]:
        state[key.replace("layers.3.", "layers.4.")] = state[key].clone()


def _index(entries: Callable[[Path], Any]) -> Callable[[Path], None]:
    """Split the weights over two files with an index whose entries ``entries(d)`` gives."""
    def go(d: Path) -> None:
        state = st.load_file(str(d / "model.safetensors"))
        (d / "model.safetensors").unlink()
        keys = sorted(state)
        st.save_file({k: state[k] for k in keys[:5]}, str(d / "a.safetensors"))
        st.save_file({k: state[k] for k in keys[5:]}, str(d / "b.safetensors"))
        weight_map = {k: "a.safetensors" for k in keys[:5]} | {k: "b.safetensors" for k in keys[5:]}
        doc = entries(d)
        doc = doc(weight_map) if callable(doc) else doc
        (d / "model.safetensors.index.json").write_text(json.dumps(doc))
    return go


def _moved_out(d: Path, name: str) -> str:
    """Move ``d/name`` next to ``d`` (another directory) and return the path back to it."""
    elsewhere = d.parent / f"{d.name}-elsewhere"
    elsewhere.mkdir()
    shutil.move(d / name, elsewhere / name)
    return str(elsewhere / name)


def _entry(value: Callable[[Path], str]) -> Callable[[Path], Any]:
    """An index whose entries for a.safetensors' tensors all say ``value(d)`` instead (where the
    file then is, so that only the check stops the load)."""
    def entries(d: Path) -> Any:
        def doc(weight_map: dict[str, str]) -> dict[str, Any]:
            name = value(d)
            return {"weight_map": {k: name if f == "a.safetensors" else f for k, f in weight_map.items()}}
        return doc
    return entries


def _sub(d: Path) -> str:
    (d / "sub").mkdir()
    shutil.move(d / "a.safetensors", d / "sub" / "a.safetensors")
    return "sub/a.safetensors"


def _link_out(d: Path) -> str:
    os.symlink(_moved_out(d, "a.safetensors"), d / "a.safetensors")
    return "a.safetensors"


def _glob_link_out(d: Path) -> None:
    os.symlink(_moved_out(d, "model.safetensors"), d / "model.safetensors")


def _twice(d: Path) -> None:
    state = st.load_file(str(d / "model.safetensors"))
    st.save_file({"model.norm.weight": state["model.norm.weight"]}, str(d / "z.safetensors"))


HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    # config.json (item 9)
    "config a list": (_raw_config(b"[1, 2]"), "config.json: holds [1, 2] (a list); expected a JSON object"),
    "config a string": (_raw_config(b'"llama"'), 'config.json: holds "llama" (a string); expected a JSON object'),
    "config null": (_raw_config(b"null"), "config.json: holds null; expected a JSON object"),
    "config garbled": (_raw_config(b'{"model_type": '), "config.json: not valid JSON"),
    "config not utf-8": (_raw_config(b'{"model_type": "\xff"}'), "config.json: not UTF-8 text"),
    "config nested deeply": (_raw_config(b"[" * 100_000), "config.json: JSON nested too deeply"),
    "config a directory": (_config_dir, "config.json: is a directory; expected a JSON file"),
    "config a link loop": (_config_loop, "config.json: cannot read it (Too many levels of symbolic links)"),
    "config a link outside": (_config_outside, "config.json: a symbolic link to"),
    "architectures an object": (lambda d: _config(d, lambda c: c.update(architectures={"a": 1})),
                                "`architectures` is {\"a\": 1} (an object); expected a list of class names"),
    "no vocab_size": (lambda d: _config(d, lambda c: c.pop("vocab_size")),
                      "`vocab_size` is missing; model `m` has vocab = 64"),
    "no num_attention_heads": (lambda d: _config(d, lambda c: c.pop("num_attention_heads")),
                               "`num_attention_heads` is missing; model `m` has heads = 4"),
    "no model_type": (lambda d: _config(d, lambda c: c.pop("model_type")), "`model_type` is missing"),
    "heads 0": (lambda d: _config(d, lambda c: c.update(num_attention_heads=0)),
                "`num_attention_heads` is 0 (an integer); expected a positive integer"),
    "hidden a string": (lambda d: _config(d, lambda c: c.update(hidden_size="32")),
                        '`hidden_size` is "32" (a string); expected a positive integer'),
    "hidden a float": (lambda d: _config(d, lambda c: c.update(hidden_size=32.5)),
                       "`hidden_size` is 32.5 (a number); expected a positive integer"),
    "tie a string": (lambda d: _config(d, lambda c: c.update(tie_word_embeddings="false")),
                     '`tie_word_embeddings` is "false" (a string); expected true or false'),
    "rope_scaling a string": (lambda d: _config(d, lambda c: c.update(rope_scaling="llama3")),
                              '`rope_scaling` is "llama3" (a string); expected an object (or null)'),
    "rope_scaling a list": (lambda d: _config(d, lambda c: c.update(rope_scaling=[8.0])),
                            "`rope_scaling` is [8.0] (a list); expected an object"),
    "rope_scaling without factor": (
        lambda d: _config(d, lambda c: c.update(rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 16})),
        "`rope_scaling` of type 'llama3' has no `factor`; expected a positive number"),
    "rope_scaling without original positions": (
        lambda d: _config(d, lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0})),
        "has no `original_max_position_embeddings`; expected a positive integer"),
    "rope factor a string": (
        lambda d: _config(d, lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": "8"})),
        '`rope_scaling`: `factor` is "8" (a string); expected a positive number'),
    "eos a string": (lambda d: _config(d, lambda c: c.update(eos_token_id="</s>")),
                     '`eos_token_id` is "</s>" (a string); expected a token id'),
    # model.safetensors.index.json (item 4)
    "index entry ../": (_index(_entry(lambda d: f"../{Path(_moved_out(d, 'a.safetensors')).parent.name}/a.safetensors")),
                        "names \"../"),
    "index entry absolute": (_index(_entry(lambda d: _moved_out(d, "a.safetensors"))), "no directories, no .."),
    "index entry in a subdirectory": (_index(_entry(_sub)), '"sub/a.safetensors" (a string); expected the name of a file'),
    "index entry a link outside": (_index(_entry(_link_out)), "a.safetensors: a symbolic link to"),
    "index entry a number": (_index(_entry(lambda d: 3)), "names 3 (an integer); expected the name of a file"),  # type: ignore[arg-type, return-value]
    "index weight_map a list": (_index(lambda d: {"weight_map": ["a.safetensors"]}),
                                '`weight_map` is ["a.safetensors"] (a list); expected an object'),
    "index without weight_map": (_index(lambda d: {"metadata": {}}), "`weight_map` is missing"),
    "index a list": (_index(lambda d: []), "model.safetensors.index.json: holds [] (a list)"),
    "weights file a link outside": (_glob_link_out, "model.safetensors: a symbolic link to"),
    "tensor in two files": (_twice, "tensor model.norm.weight is stored twice"),
    # dtypes and tensors the model has no place for (item 7)
    "q_proj int32": (_tensors(lambda s: s.update({"model.layers.0.self_attn.q_proj.weight":
                                                  s["model.layers.0.self_attn.q_proj.weight"].to(torch.int32)})),
                     "tensor model.layers.0.self_attn.q_proj.weight in"),
    "norm bool": (_tensors(lambda s: s.update({"model.norm.weight": s["model.norm.weight"] > 1})),
                  "tensor model.norm.weight in"),
    "a block too many": (_tensors(_third_layer),
                         "9 tensors that model `m` has no place for (model.layers.4.input_layernorm.weight, "
                         "model.layers.4.mlp.down_proj.weight, model.layers.4.mlp.gate_proj.weight and 6 more);"
                         " pass --weights-extra ignore"),
    "an mlp bias": (_tensors(lambda s: s.update({"model.layers.0.mlp.down_proj.bias": torch.zeros(32)})),
                    "1 tensor that model `m` has no place for (model.layers.0.mlp.down_proj.bias)"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_weights_are_one_line_naming_what_is_wrong(case: str, llama: Path, program: Any, tmp_path: Path) -> None:
    mutate, expected = HOSTILE[case]
    d = tmp_path / "model"
    shutil.copytree(llama, d)
    mutate(d)
    with pytest.raises(hf.WeightsError) as err:
        hf.check_weights(d, program)
    message = str(err.value)
    assert expected in message and "\n" not in message, message
    if "dtype" in case or case in ("q_proj int32", "norm bool"):
        assert ("stored as I32" if "int32" in case else "stored as BOOL") in message
        assert "expected one of BF16, F16, F32" in message


def test_extra_tensors_are_accepted_with_the_flag_and_listed(llama: Path, program: Any, tmp_path: Path) -> None:
    d = tmp_path / "model"
    shutil.copytree(llama, d)
    _tensors(lambda s: s.update({"model.layers.0.mlp.down_proj.bias": torch.zeros(32)}))(d)
    extras = hf.check_weights(d, program, extra="ignore")
    assert extras == ["model.layers.0.mlp.down_proj.bias"]
    assert "ignoring 1 tensor the model has no place for (model.layers.0.mlp.down_proj.bias)" in hf.extras_note(d, extras)


def test_buffers_older_checkpoints_carry_are_not_extra(llama: Path, program: Any, tmp_path: Path) -> None:
    d = tmp_path / "model"
    shutil.copytree(llama, d)
    _tensors(lambda s: s.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))(d)
    assert hf.check_weights(d, program) == []


def _hf_cache(llama: Path, root: Path) -> Path:
    """``llama`` as the Hugging Face cache stores it: every snapshot file a link to ../../blobs/<sha>."""
    import hashlib

    repo = root / "models--x--tiny"
    snapshot = repo / "snapshots" / ("ab" * 20)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in llama.iterdir():
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / sha)
        os.symlink(f"../../blobs/{sha}", snapshot / f.name)
    return snapshot


def test_a_hugging_face_cache_snapshot_still_loads(llama: Path, program: Any, tmp_path: Path) -> None:
    snapshot = _hf_cache(llama, tmp_path)
    assert hf.check_weights(snapshot, program) == []
    assert hf.HFCheckpoint(snapshot).config["model_type"] == "llama"


# ---------------------------------------------------------------- --export-hf OUT (items 1, 3)


def _foreign_model(out: Path, llama: Path) -> None:
    out.mkdir()
    shutil.copyfile(llama / "config.json", out / "config.json")


def _compile_package(out: Path, llama: Path) -> None:
    from meshllm_dsl.runtime.outputs import write_generated

    write_generated({"p.py": "x = 1\n"}, out)


def _exported_then_edited(out: Path, llama: Path) -> None:
    from meshllm_dsl.runtime.outputs import manifest_bytes

    out.mkdir()
    (out / "config.json").write_text("{}\n")
    import hashlib

    (out / MANIFEST).write_bytes(manifest_bytes({"config.json": hashlib.sha256(b"{}\n").hexdigest()}, {}))
    (out / "config.json").write_text('{"edited": true}\n')


def _exported_then_added(out: Path, llama: Path) -> None:
    from meshllm_dsl.runtime.outputs import manifest_bytes

    out.mkdir()
    (out / MANIFEST).write_bytes(manifest_bytes({}, {}))
    shutil.copyfile(llama / "model.safetensors", out / "model.safetensors")


EXPORT_REFUSED: dict[str, tuple[Callable[[Path, Path], Any], str]] = {
    "a file": (lambda out, w: out.write_text("mine"), "exists and is not a directory"),
    "a dangling link": (lambda out, w: os.symlink(out.parent / "gone", out), "a dangling symbolic link"),
    "another model's directory": (_foreign_model, "the directory is not empty and meshc did not write it"),
    "the --weights directory": (lambda out, w: os.symlink(w, out), "is the --weights directory"),
    "inside --weights": ("inside", "is inside the --weights directory"),  # type: ignore[dict-item]
    "a meshc compile package": (_compile_package, "holds meshc's generated files (p.py), not an export"),
    "an export edited since": (_exported_then_edited, "config.json was changed since meshc wrote it"),
    "an export with a foreign file": (_exported_then_added, "model.safetensors exists and was not written by meshc"),
    "under a file": ("under", "is not a directory"),  # type: ignore[dict-item]
}


@pytest.mark.parametrize("case", list(EXPORT_REFUSED))
def test_export_targets_that_would_lose_a_file_are_refused_before_training(
    case: str, llama: Path, tmp_path: Path
) -> None:
    make, expected = EXPORT_REFUSED[case]
    weights = tmp_path / "w"
    shutil.copytree(llama, weights)
    out = tmp_path / "out"
    if make == "inside":
        out = weights / "export"
    elif make == "under":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "out"
    else:
        make(out, weights)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(hf.ExportError) as err:
        hf.check_export_dir(out, weights)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert str(out) in str(err.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_garbled_generation_config_is_refused_before_an_export(llama: Path, tmp_path: Path) -> None:
    weights = tmp_path / "w"
    shutil.copytree(llama, weights)
    (weights / "generation_config.json").write_text('{"eos_token_id": "</s>"}')
    with pytest.raises(hf.WeightsError, match='generation_config.json: `eos_token_id` is "</s>" \\(a string\\)'):
        hf.check_export_dir(tmp_path / "out", weights)
    (weights / "generation_config.json").write_text("{not json")
    with pytest.raises(hf.WeightsError, match="generation_config.json: not valid JSON"):
        hf.check_export_dir(tmp_path / "out", weights)


def test_export_writes_like_compile_and_copies_only_links_that_stay_inside(
    llama: Path, plan_module: str, pool: WorkerPool, tmp_path: Path
) -> None:
    """New directory, then again into it: only meshc's files replaced, stale shards removed, the
    user's own file kept; a tokenizer link to a secret outside is not copied, an HF cache snapshot's are."""
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    weights = _hf_cache(llama, tmp_path / "cache")
    os.symlink(secret, weights / "tokenizer.model")
    out = tmp_path / "out"
    pool.run(export_job, 1, plan_module, str(weights), str(out), 40_000)  # several shards + index
    names = sorted(p.name for p in out.iterdir())
    assert "tokenizer.model" not in names  # the secret stays where it is
    assert not any(b"PRIVATE KEY" in p.read_bytes() for p in out.iterdir())
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", MANIFEST} <= set(names)
    assert (out / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes()
    assert not (out / "tokenizer.json").is_symlink()
    assert len([n for n in names if n.startswith("model-")]) > 1 and "model.safetensors.index.json" in names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left
    (out / "NOTES.md").write_text("mine")
    hf.check_export_dir(out, weights)  # meshc's own export: may be written again
    pool.run(export_job, 1, plan_module, str(weights), str(out), 10**9)  # one file now
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and not [n for n in names if n.startswith("model-")]
    assert "model.safetensors.index.json" not in names  # a stale index would load the old shards
    assert (out / "NOTES.md").read_text() == "mine"
    got = st.load_file(str(out / "model.safetensors"))
    want = st.load_file(str(llama / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_meshc_run_refuses_an_export_onto_a_file_before_training(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshllm_dsl.cli import job as cli_job
    from meshllm_dsl.cli import main as cli

    def no_launch(*args: object, **kwargs: object) -> int:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(cli_job, "run_job", no_launch)
    spec_path = tmp_path / "m.mesh"
    spec_path.write_text(spec("llama", "single"))
    target = tmp_path / "trained"
    target.write_text("my notes")
    code = cli.main(["run", str(spec_path), "--weights", str(llama), "--steps", "3", "--export-hf", str(target)])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "launching" not in err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert f"--export-hf {target}: exists and is not a directory" in line
    assert target.read_text() == "my notes"


def test_a_tokenizer_link_leading_outside_is_skipped_with_one_line_naming_it(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    weights = tmp_path / "w"
    shutil.copytree(llama, weights)
    os.symlink(secret, weights / "tokenizer.model")
    os.symlink("tokenizer.json", weights / "vocab.json")  # a link inside the directory is followed

    class Collect:
        names: list[str] = []

        def put(self, name: str, write: Callable[[Path], None]) -> None:
            self.names.append(name)

    hf._copy_source_files(weights, Collect())  # type: ignore[arg-type]
    assert sorted(Collect.names) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"--export-hf: not copying {weights / 'tokenizer.model'}: a symbolic link to {secret},"
                    " outside the model directory")
