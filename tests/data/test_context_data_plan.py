"""The planner's within-row context-parallel model (issue 41, item 3): with context axes a device is
a data rank x a context rank, its attention work its context rank's pairs of its data rank's rows
as the runtime splits them (`context_balance`, runtime/parallel/context_layout.py); `meshc plan
--data` waits for the busiest device, reports the excess in its data and context parts and under
every balance, and warns (W0809) when the context part passes 10 %."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_packing import _docs, write_corpus  # noqa: E402

from meshllm_dsl.checker import check_text  # noqa: E402
from meshllm_dsl.cli.main import main  # noqa: E402
from meshllm_dsl.parallel.devices import PROFILES  # noqa: E402
from meshllm_dsl.planner.analyze import analyze  # noqa: E402
from meshllm_dsl.planner.data import (  # noqa: E402
    DATA_SKEW_WARN,
    Row,
    data_attention,
    data_profile,
    data_warnings,
)

torch = pytest.importorskip("torch")

SEQ = 64
MODEL = "model m = llama { vocab = 1000, hidden = 512, layers = 2, heads = 8, kv_heads = 4, ffn = 1024 }"


def _spec(balance: str | None = None, data: int = 2, cp: int = 4, batch: int = 8, pack: bool = True) -> str:
    return (f"mesh m {{ axes data = {data}, cp = {cp}\n device = h100 }}\n{MODEL}\nplan p on m for m {{\n"
            f"    batch = {batch}\n    seq = {SEQ}\n    layout {{ batch -> data, seq -> cp }}\n"
            + ("    pack = documents\n" if pack else "")
            + (f"    context_balance = {balance}\n" if balance else "") + "}\n")


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mostly documents of 1 - 5 tokens with one in ten a whole row: head-tail leaves the long
    document's late queries on the context ranks holding the row's last chunks."""
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in np.where(rng.random(400) < 0.1, SEQ - 1, rng.integers(1, 6, size=400))]
    return write_corpus(tmp_path_factory.mktemp("cp") / "skewed.tok", _docs(lengths))


# -- the arithmetic, by hand
#
# seq 8 over 2 context ranks: head-tail gives rank 0 positions 0, 1, 6, 7 and rank 1 positions 2 - 5.
# Row A, one document of 8: its queries see 1 .. 8 keys: rank 0 1 + 2 + 7 + 8 = 18, rank 1 3 + 4 + 5 + 6 = 18.
# Row B, documents of 2 and 6: its queries see 1 2 | 1 2 3 4 5 6: rank 0 1 + 2 + 5 + 6 = 14, rank 1 1 + 2 + 3 + 4 = 10.
# In the planner's unit (a document counts L squared): 2 x causal - the rank's 4 tokens: A 32 | 32, B 24 | 16.
A, B = Row((8,), 8), Row((2, 6), 8)
HEADTAIL = [[18, 18], [14, 10]]  # [row][context rank]


def test_a_devices_work_is_its_context_ranks_pairs_of_its_data_ranks_rows() -> None:
    # One data rank holding both rows: its two devices do 32 + 24 and 32 + 16.
    p = data_profile([[A, B]], seq=8, ranks=1, masked=True, balanced=False, contexts=2,
                     context_balance="headtail", context_pairs={"headtail": [HEADTAIL]})
    (split,) = p.splits
    assert split.pairs == ((56, 48),) and split.busiest_pairs == 56
    assert p.pairs == 64 + 40 and p.busiest_pairs == 104 and p.busiest_device_pairs == 56
    assert p.devices == 2
    assert p.data_excess == 0  # one data rank
    assert p.excess == pytest.approx(56 * 2 / 104 - 1) and p.context_excess == pytest.approx(8 / 104)
    assert p.busiest_share == pytest.approx(56 * 2 / (2 * 64))
    # Two data ranks, a row each: the data ranks are uneven (64 against 40), each one's devices even.
    p = data_profile([[A, B]], seq=8, ranks=2, masked=True, balanced=False, contexts=2,
                     context_balance="headtail", context_pairs={"headtail": [HEADTAIL]})
    assert p.splits[0].pairs == ((32, 32), (24, 16))
    assert p.data_excess == pytest.approx(64 * 2 / 104 - 1) and p.excess == pytest.approx(32 * 4 / 104 - 1)
    assert p.context_excess == pytest.approx(0)


def test_every_balance_is_measured_on_the_same_rows_the_plans_first() -> None:
    # per_document deals row B as 0 1 | 0 1 0 1 1 0 (each document's remainder round-robin): 11 | 13.
    pairs = {"headtail": [HEADTAIL], "per_document": [[[18, 18], [11, 13]]]}
    p = data_profile([[A, B]], seq=8, ranks=1, masked=True, balanced=False, contexts=2,
                     context_balance="per_document", context_pairs=pairs)
    assert [s.balance for s in p.splits] == ["per_document", "headtail"]
    assert p.splits[0].pairs == ((32 + 18, 32 + 22),) and p.busiest_device_pairs == 54
    assert p.split_excess(p.splits[1]) == pytest.approx(56 * 2 / 104 - 1)
    with pytest.raises(ValueError, match="context_balance = ptrr"):
        data_profile([[A, B]], seq=8, ranks=1, masked=True, balanced=False, contexts=2, context_balance="ptrr",
                     context_pairs=pairs)
    with pytest.raises(ValueError, match="not those of the rows"):
        data_profile([[A, B]], seq=8, ranks=1, masked=True, balanced=False, contexts=2,
                     context_pairs={"headtail": [[[18, 18], [14, 11]]]})


def test_without_a_document_mask_the_context_ranks_are_even() -> None:
    p = data_profile([[A, B]], seq=8, ranks=2, masked=False, balanced=False, contexts=2)
    assert not p.splits and p.busiest_device_pairs == 64 // 2
    assert p.excess == p.data_excess == 0 and p.context_excess == 0


def test_measure_data_splits_the_rows_as_rank_pairs_does_by_hand() -> None:
    from meshllm_dsl.cli.data import _context_pairs

    got = _context_pairs([[A, B]], 2)
    # ptrr: blocks of 2 (gcd(128, 8 / 4)); row A's [3, 7, 11, 15] dealt 3 -> 0, 2 -> 1, 1 -> 1, 0 -> 0;
    # row B's [3, 3, 7, 11] dealt 3 -> 0, 2 -> 1, 0 -> 1, 1 -> 0 (ties in row order).
    assert got == {"headtail": [HEADTAIL], "per_document": [[[18, 18], [11, 13]]], "ptrr": [[[18, 18], [14, 10]]]}


def test_the_context_warning_says_when_the_plans_balance_is_already_the_best() -> None:
    # Row B alone on one data rank: head-tail 24 | 16 (20% over the even 20 | 20), a split the
    # other way as bad; the plan's balance wins the tie.
    pairs = {"headtail": [[[14, 10]]], "ptrr": [[[10, 14]]]}
    profile = data_profile([[B]], seq=8, ranks=1, masked=True, balanced=False, contexts=2, context_pairs=pairs)
    assert profile.context_excess == pytest.approx(0.2)
    plan = check_text(_spec(), "t.mesh").plans["p"]
    rep = analyze(plan, PROFILES["h100"])
    (w,) = data_warnings(rep, data_attention(rep, profile))
    assert w.code == "W0809" and "20% of it on top of the busiest data rank's 0%" in w.message
    assert w.help == ("`headtail` already measured best on these rows (headtail 20.0%, ptrr 20.0%); fewer context "
                      "ranks (more data ranks) split each row's documents less")


# -- against the runtime


@pytest.mark.parametrize(("cp", "balance"), [(2, False), (4, False), (2, True)])
def test_the_planners_devices_are_the_runtimes_layout(skewed: Path, cp: int, balance: bool) -> None:
    """Each device's work as the planner measures it equals the pairs of the queries the runtime's
    layout hands its context rank (context_layout.layout + query_pairs), in the runtime's own batches
    (Packer.next_batch: the documents its ranks mask by, each data rank a slice of the rows; with
    `--balance` as `meshc run --balance` packs them)."""
    from meshllm_dsl.cli.data import measure_data
    from meshllm_dsl.runtime.data.corpus import open_corpus
    from meshllm_dsl.runtime.data.packing import Packer
    from meshllm_dsl.runtime.parallel.context_layout import BALANCES, layout, query_pairs

    steps, ranks, batch = 6, 2, 4
    for context_balance in BALANCES:
        plan = check_text(_spec(context_balance, data=ranks, cp=cp, batch=batch), "t.mesh").plans["p"]
        p = measure_data([(open_corpus(skewed), 1.0)], plan, seed=5, steps=steps, balance=balance)
        packer = Packer([(open_corpus(skewed), 1.0)], seq=SEQ, seed=5, balance=ranks if balance else 0)
        device = torch.zeros(ranks, cp, dtype=torch.int64)
        busiest = 0
        for _ in range(steps):
            documents = packer.next_batch(batch).documents
            work = torch.zeros(ranks, cp, dtype=torch.int64)
            for r, rows in enumerate(documents.chunk(ranks)):
                order, pairs = layout(rows, cp, context_balance), query_pairs(rows)
                for c, held in enumerate(order.chunk(cp, dim=1)):  # rank c's positions of each row
                    # In the planner's unit: twice the causal pairs less the queries (the diagonal once).
                    work[r, c] = 2 * int(pairs.gather(1, held).sum()) - held.numel()
            device += work
            busiest += int(work.max())
        mine = p.splits[0]
        assert mine.balance == context_balance == p.context_balance
        assert mine.pairs == tuple(tuple(row) for row in device.tolist())
        assert mine.busiest_pairs == busiest
        assert int(device.sum()) == p.pairs  # the devices split the rows' squared lengths exactly


def test_the_context_warning_fires_for_headtail_and_not_per_document(skewed: Path) -> None:
    from meshllm_dsl.cli.data import measure_data
    from meshllm_dsl.runtime.data.corpus import open_corpus

    found = {}
    for balance in (None, "per_document"):
        plan = check_text(_spec(balance), "t.mesh").plans["p"]
        rep = analyze(plan, PROFILES["h100"])
        profile = measure_data([(open_corpus(skewed), 1.0)], plan, seed=0, steps=20, balance=False)
        found[balance] = (profile, data_warnings(rep, data_attention(rep, profile)))
    headtail, warns = found[None]
    assert headtail.context_excess > DATA_SKEW_WARN
    (w,) = [d for d in warns if d.code == "W0809"]
    assert w.span is not None and w.span.text == "pack"  # no `context_balance` written: at `pack`
    assert f"{headtail.context_excess:.0%} of it on top of the busiest data rank's" in w.message
    assert w.help is not None and w.help.startswith("`context_balance = per_document` measured best")
    per_document, warns = found["per_document"]
    assert per_document.context_excess < DATA_SKEW_WARN and "W0809" not in [d.code for d in warns]
    # The same rows, the same data part; switching gives what the head-tail plan's report measured.
    assert per_document.data_excess == pytest.approx(headtail.data_excess)
    assert per_document.excess == pytest.approx(headtail.split_excess(
        next(s for s in headtail.splits if s.balance == "per_document")))


def test_the_context_warning_points_at_a_written_balance(skewed: Path) -> None:
    from meshllm_dsl.cli.data import measure_data
    from meshllm_dsl.runtime.data.corpus import open_corpus

    plan = check_text(_spec("ptrr"), "t.mesh").plans["p"]
    rep = analyze(plan, PROFILES["h100"])
    profile = measure_data([(open_corpus(skewed), 1.0)], plan, seed=0, steps=20, balance=False)
    assert profile.context_excess > DATA_SKEW_WARN
    (w,) = [d for d in data_warnings(rep, data_attention(rep, profile)) if d.code == "W0809"]
    assert w.span is not None and w.span.text == "context_balance"
    assert "`context_balance = per_document` measured best" in (w.help or "")


# -- the command


def test_plan_data_reports_the_busiest_device_under_every_balance(capsys: pytest.CaptureFixture[str],
                                                                  skewed: Path, tmp_path: Path) -> None:
    spec = tmp_path / "cp.mesh"
    spec.write_text(_spec())
    assert main(["plan", str(spec), "--data", str(skewed)]) == 0
    out = capsys.readouterr().out
    assert "waiting for the busiest device" in out and "over 2 data x 4 context ranks: data ranks" in out
    assert "context_balance             excess   context part   step" in out
    assert "headtail (the plan's)" in out and "per_document" in out and "ptrr" in out
    assert "warning[W0809]" in out and "help: `context_balance = per_document` measured best" in out

    assert main(["plan", str(spec), "--data", str(skewed), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    d = report["plans"][0]["data"]
    assert d["context_ranks"] == 4 and d["context_balance"] == "headtail" and d["data_ranks"] == 2
    assert d["attention_excess"] == pytest.approx(d["attention_excess_data"] + d["attention_excess_context"])
    assert d["excess_s"] == pytest.approx(d["excess_s_data"] + d["excess_s_context"])
    assert d["attention_excess_context"] > DATA_SKEW_WARN
    assert list(d["context_balances"]) == ["headtail", "per_document", "ptrr"]
    assert d["context_balances"]["headtail"]["step_s"] == pytest.approx(d["step_s"])
    shares = d["context_balances"]["ptrr"]["device_attention_shares"]
    assert len(shares) == 2 and len(shares[0]) == 4 and sum(map(sum, shares)) == pytest.approx(1)
    assert [x["code"] for x in report["diagnostics"]].count("W0809") == 1

    # Switching to the balance measured best gives the plan what the report said it would.
    spec.write_text(_spec("per_document"))
    assert main(["plan", str(spec), "--data", str(skewed), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    after = report["plans"][0]["data"]
    assert after["attention_excess"] == pytest.approx(d["context_balances"]["per_document"]["attention_excess"])
    assert after["step_s"] == pytest.approx(d["context_balances"]["per_document"]["step_s"])
    assert "W0809" not in [x["code"] for x in report["diagnostics"]]


def test_data_stats_with_a_context_plan(capsys: pytest.CaptureFixture[str], skewed: Path, tmp_path: Path) -> None:
    spec = tmp_path / "cp.mesh"
    spec.write_text(_spec())
    assert main(["data-stats", str(skewed), "--plan", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "busiest device's attention excess" in out and "warning[W0809]" in out


def test_the_context_warning_renders_at_the_written_balance(capsys: pytest.CaptureFixture[str], skewed: Path,
                                                            tmp_path: Path) -> None:
    spec = tmp_path / "cp.mesh"
    spec.write_text(_spec("ptrr"))
    assert main(["plan", str(spec), "--data", str(skewed)]) == 0
    out = capsys.readouterr().out
    warning = out[out.index("warning[W0809]"):]
    line = next(i for i, text in enumerate(_spec("ptrr").splitlines(), 1) if "context_balance" in text)
    assert f" --> {spec}:{line}:5\n" in warning
    assert f"{line} |     context_balance = ptrr\n" in warning
    assert "  |     ^^^^^^^^^^^^^^^ context ranks' attention uneven by more than 10%\n" in warning
    assert "= help: `context_balance = per_document` measured best on these rows: the context part " in warning


def test_plan_data_splits_a_tokenized_jsonl_over_the_context_ranks(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path, tok_dir: Path) -> None:
    from alice_corpus import ALICE

    src = tmp_path / "docs.jsonl"
    long_doc = " ".join(ALICE)
    src.write_text("".join(json.dumps({"text": long_doc if i % 10 == 0 else "Alice."}) + "\n" for i in range(200)))
    spec = tmp_path / "cp.mesh"
    spec.write_text(_spec())
    assert main(["plan", str(spec), "--data", str(src), "--tokenizer", str(tok_dir), "--data-cache",
                 str(tmp_path / "cache"), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)["plans"][0]["data"]
    assert d["document_mask"] and d["documents"] > d["rows"] and d["context_ranks"] == 4
    for split in d["context_balances"].values():  # every balance splits the same rows' pairs
        assert sum(map(sum, split["device_attention_shares"])) == pytest.approx(1)
        assert split["attention_excess"] >= d["attention_excess_data"]
