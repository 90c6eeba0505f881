"""`meshc run --data SPEC --tokenizer DIR` end to end: JSONL, Parquet and a saved `datasets`
directory of real text (and a chat JSONL, trained on the assistant's tokens) are tokenized once,
before the ranks start, into cached corpora that the ranks train on as packed batches of a weighted
mix; a second run reads the cache, and bad input stops the run with one line naming file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from alice_corpus import ALICE, build_tokenizer  # noqa: E402
from processes import run_module  # noqa: E402

SPEC = """
mesh m { axes data = 2 }
model tiny = llama { vocab = 512, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64 }
plan train on m for tiny {
    batch = 4
    seq = 32
    layout { batch -> data }
    optimizer adamw { lr = 0.003 }
}
"""


def _sources(tmp: Path) -> dict[str, Path]:
    half = len(ALICE) // 2
    jsonl = tmp / "alice.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in ALICE[:half]))
    parquet = tmp / "alice.parquet"
    pq.write_table(pa.table({"text": ALICE[half:]}), parquet)
    chats = tmp / "chats.jsonl"
    chats.write_text("".join(json.dumps({"text": [{"role": "user", "content": "Who was late?"},
                                                  {"role": "assistant", "content": t}]}) + "\n" for t in ALICE[:4]))
    return {"jsonl": jsonl, "parquet": parquet, "chats": chats}


# Document masks under tensor x context parallelism (sequence parallel over both, as
# examples/tiny_llama_context.mesh): the corpora's documents reach every rank's attention.
MASKED = """
mesh m { axes tensor = 2, cp = 2 }
model tiny = llama { vocab = 512, hidden = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 64 }
plan train on m for tiny {
    batch = 4
    seq = 32
    pack = documents
    positions = restart
    layout { seq -> tensor * cp, heads -> tensor, kv_heads -> tensor, ffn -> tensor, vocab -> tensor }
    optimizer adamw { lr = 0.003 }
}
"""


def _run(tmp: Path, *args: str, spec_text: str = SPEC) -> tuple[int, str]:
    spec = tmp / "tiny.mesh"
    spec.write_text(spec_text)
    proc = run_module("meshllm_dsl", "run", str(spec), "--timeout", "120", *args, timeout=300, cwd=tmp)
    return proc.returncode, proc.stderr


def test_run_trains_on_a_weighted_mix_of_sources_tokenized_once(tmp_path: Path) -> None:
    """JSONL, Parquet and a saved dataset of real text, weighted, with document masks under tensor x
    context parallelism; the second run reads the cache and trains on the same batches."""
    tok = build_tokenizer(tmp_path / "tok")
    src = _sources(tmp_path)
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "alice_ds"
    datasets.Dataset.from_dict({"text": ALICE}).save_to_disk(str(saved))
    spec = f"{src['jsonl']}:0.5,{src['parquet']}:0.3,{saved}:0.2"
    cache = tmp_path / "cache"
    code, err = _run(tmp_path, "--data", spec, "--tokenizer", str(tok), "--data-cache", str(cache), "--steps", "3",
                     "--metrics", str(tmp_path / "m.jsonl"), spec_text=MASKED)
    assert code == 0, err[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
    corpora = sorted(cache.glob("*.tokens"))
    assert len(corpora) == 3 and all(Path(f"{c}.docs").is_file() for c in corpora)
    stamps = {c: c.stat().st_mtime_ns for c in corpora}
    # The same run again reads the cache (nothing re-tokenized) and trains on the same batches.
    code, err = _run(tmp_path, "--data", spec, "--tokenizer", str(tok), "--data-cache", str(cache), "--steps", "3",
                     "--metrics", str(tmp_path / "again.jsonl"), spec_text=MASKED)
    assert code == 0, err[-3000:]
    assert {c: c.stat().st_mtime_ns for c in corpora} == stamps
    again = [json.loads(line)["loss"] for line in (tmp_path / "again.jsonl").read_text().splitlines()]
    assert again == losses


def test_run_trains_a_chat_on_its_assistant_tokens(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    src = _sources(tmp_path)
    code, err = _run(tmp_path, "--data", str(src["chats"]), "--tokenizer", str(tok), "--data-cache",
                     str(tmp_path / "cache"), "--steps", "2")
    assert code == 0, err[-3000:]
    (mask,) = (tmp_path / "cache").glob("*.lossmask")
    assert 0 < sum(mask.read_bytes()) < mask.stat().st_size  # only the assistant's tokens are targets


def test_run_stops_at_a_bad_line_naming_it(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": ALICE[0]}) + "\n{not json\n")
    code, err = _run(tmp_path, "--data", str(bad), "--tokenizer", str(tok), "--data-cache", str(tmp_path / "cache"))
    assert code == 2 and f"{bad}:2" in err and "Traceback" not in err, err
    assert not list((tmp_path / "cache").glob("*.tokens"))
    code, err = _run(tmp_path, "--data", str(bad), "--tokenizer", str(tok), "--data-cache", str(tmp_path / "cache"),
                     "--skip-bad", "--steps", "1")
    assert code == 0 and "skipped 1 bad" in err, err[-3000:]


def test_a_document_masked_plan_trains_on_documents_and_refuses_windows(tmp_path: Path) -> None:
    """`pack = documents`: a text file with --tokenizer is tokenized into its documents (blank lines)
    and trained on packed; the same file as bytes (no tokenizer) would be windows across documents:
    refused before any rank starts."""
    tok = build_tokenizer(tmp_path / "tok")
    text = tmp_path / "alice.txt"
    text.write_text("\n\n".join(ALICE) + "\n")
    spec = tmp_path / "masked.mesh"
    spec.write_text(SPEC.replace("    batch = 4\n", "    batch = 4\n    pack = documents\n    positions = restart\n"))
    proc = run_module("meshllm_dsl", "run", str(spec), "--timeout", "120", "--data", str(text), "--tokenizer", str(tok),
                      "--data-cache", str(tmp_path / "cache"), "--steps", "2", timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (corpus,) = (tmp_path / "cache").glob("*.tokens")
    assert Path(f"{corpus}.docs").is_file()
    proc = run_module("meshllm_dsl", "run", str(spec), "--timeout", "120", "--data", str(text), "--steps", "1",
                      timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and "`pack = documents`" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("balance", ["per_document", "ptrr"])
def test_run_spreads_the_rows_by_their_documents(tmp_path: Path, balance: str) -> None:
    """`context_balance` through `meshc run`: the same real-text batches under tensor x context
    parallelism train to the head-tail run's losses (the same sums in another order over the ranks)."""
    tok = build_tokenizer(tmp_path / "tok")
    src = _sources(tmp_path)
    cache = tmp_path / "cache"
    losses = {}
    for name, text in (("headtail", MASKED), (balance, MASKED.replace(
            "    positions = restart\n", f"    positions = restart\n    context_balance = {balance}\n"))):
        code, err = _run(tmp_path, "--data", str(src["jsonl"]), "--tokenizer", str(tok), "--data-cache", str(cache),
                         "--steps", "3", "--metrics", str(tmp_path / f"{name}.jsonl"), spec_text=text)
        assert code == 0, err[-3000:]
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    first, then = losses["headtail"], losses[balance]
    # The same parameters at step 0: the same loss to rounding; after fp32 AdamW steps (which move an
    # element whose gradient is rounding noise by lr either way) close, not equal (float64 EQUAL:
    # tests/runtime/test_document_mask.py).
    assert len(first) == 3 and abs(first[0] - then[0]) <= 1e-6 * first[0], losses
    assert all(abs(a - b) <= 1e-4 * a for a, b in zip(first, then)), losses
