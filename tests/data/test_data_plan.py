"""The planner on real data (issue 41, items 3 and 4): `meshc plan --data` prices the attention of
`pack = documents` by the packed rows' documents (sum of squared lengths, not seq squared), and it
and `meshc data-stats --plan` report each data rank's share of tokens and attention work over the
first steps of the seeded order, warning (W0808) when the busiest rank's excess passes 10 %."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

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
    row_pairs,
)

SEQ = 64
MODEL = "model m = llama { vocab = 1000, hidden = 512, layers = 2, heads = 8, kv_heads = 4, ffn = 1024 }"


def _spec(pack: bool = True, data: int = 4, batch: int = 8) -> str:
    return (f"mesh m {{ axes data = {data}\n device = h100 }}\n{MODEL}\nplan p on m for m {{\n    batch = {batch}\n"
            f"    seq = {SEQ}\n    layout {{ batch -> data }}\n" + ("    pack = documents\n" if pack else "") + "}\n")


def _skewed_lengths() -> list[int]:
    """Mostly documents of 1 - 5 tokens with one in ten a whole row: rows of very different attention work."""
    rng = np.random.default_rng(0)
    return [int(x) for x in np.where(rng.random(400) < 0.1, SEQ - 1, rng.integers(1, 6, size=400))]


@pytest.fixture
def skewed(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "skewed.tok", _docs(_skewed_lengths()))


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "p.mesh"
    path.write_text(_spec())
    return path


def _meshc(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- the arithmetic


def test_a_rows_attention_is_the_sum_of_its_documents_squared_lengths_under_the_mask() -> None:
    row = Row((3, 5, 56), trained=64)
    assert row_pairs(row, 64, masked=True) == 9 + 25 + 56 * 56
    assert row_pairs(row, 64, masked=False) == 64 * 64  # every token over all seq keys


def test_the_profile_sums_each_ranks_rows_and_the_busiest_per_step() -> None:
    # 2 steps of 4 rows over 2 ranks (rows 0, 1 to rank 0; rows 2, 3 to rank 1).
    steps = [[Row((8,), 8), Row((4, 4), 8), Row((2, 6), 6), Row((1, 7), 8)],
             [Row((1, 7), 8), Row((8,), 8), Row((8,), 8), Row((8,), 4)]]
    p = data_profile(steps, seq=8, ranks=2, masked=True, balanced=False)
    work = [[64 + 32, 40 + 50], [50 + 64, 64 + 64]]  # [step][rank]
    assert p.pairs == 96 + 90 + 114 + 128
    assert p.busiest_pairs == 96 + 128
    assert p.attention == pytest.approx(((96 + 114) / p.pairs, (90 + 128) / p.pairs))
    assert p.tokens == pytest.approx(((8 + 8 + 8 + 8) / 58, (6 + 8 + 8 + 4) / 58))
    assert p.documents == 12
    assert p.upper_pairs == 2 * 4 * 64
    assert p.even_share == pytest.approx(p.pairs / 512)
    assert p.excess == pytest.approx(sum(max(w) for w in work) * 2 / p.pairs - 1)
    plain = data_profile(steps, seq=8, ranks=2, masked=False, balanced=False)
    assert plain.attention == (0.5, 0.5) and plain.excess == 0 and plain.even_share == 1


def test_the_profile_refuses_a_batch_that_does_not_split() -> None:
    with pytest.raises(ValueError, match="does not split over 4"):
        data_profile([[Row((8,), 8)] * 6], seq=8, ranks=4, masked=True, balanced=False)


@pytest.mark.parametrize("balance", [False, True])
def test_the_measured_shares_are_the_packers_own(skewed: Path, balance: bool) -> None:
    """measure_data packs with the runtime's Packer (numpy rows) and repacks as `--balance` does:
    the same shares and excess as runtime/data/packing.py's data_skew over the same batches."""
    from meshllm_dsl.cli.data import measure_data
    from meshllm_dsl.runtime.data.corpus import open_corpus
    from meshllm_dsl.runtime.data.packing import Packer, data_skew

    plan = check_text(_spec(), "t.mesh").plans["p"]
    corpus = open_corpus(skewed)
    p = measure_data([(corpus, 1.0)], plan, seed=3, steps=12, balance=balance)
    skew = data_skew(Packer([(corpus, 1.0)], seq=SEQ, seed=3, balance=4 if balance else 0), batch=8, ranks=4, steps=12)
    assert list(p.tokens) == pytest.approx(skew.tokens)
    assert list(p.attention) == pytest.approx(skew.attention)
    assert p.excess == pytest.approx(skew.excess)


def test_the_planner_prices_the_attention_core_by_the_documents(skewed: Path) -> None:
    from meshllm_dsl.cli.data import measure_data
    from meshllm_dsl.runtime.data.corpus import open_corpus

    plan = check_text(_spec(), "t.mesh").plans["p"]
    rep = analyze(plan, PROFILES["h100"])
    profile = measure_data([(open_corpus(skewed), 1.0)], plan, seed=0, steps=10, balance=False)
    da = data_attention(rep, profile)
    # The attention core over all seq keys: q k^T and p v, 2 s^2 (heads x head_dim) flops each per
    # layer and sequence, times 3 for forward and backward, over the batch.
    assert da.upper_flops == pytest.approx(3 * 2 * 2 * 2 * SEQ * SEQ * 512 * 8)
    assert da.flops == pytest.approx(da.upper_flops * profile.pairs / (10 * 8 * SEQ * SEQ))
    assert 0 < profile.even_share < profile.busiest_share < 1
    assert da.step_s == rep.step.total_s
    assert 0 < da.core_s < da.step_s
    assert da.even_step_s == pytest.approx(da.step_s - da.core_s * (1 - profile.even_share))
    assert da.busiest_step_s == pytest.approx(da.step_s - da.core_s * (1 - profile.busiest_share))
    assert da.excess_s == pytest.approx(da.core_s * (profile.busiest_share - profile.even_share))
    assert profile.excess > DATA_SKEW_WARN
    (w,) = data_warnings(rep, da)
    assert w.code == "W0808" and f"{profile.excess:.0%} more attention work" in w.message


# -- the commands


def test_plan_data_warns_on_skew_and_balance_shrinks_it(capsys: pytest.CaptureFixture[str], skewed: Path,
                                                       spec_file: Path) -> None:
    code, out, _ = _meshc(capsys, "plan", str(spec_file), "--data", str(skewed), "--steps", "20")
    assert code == 0
    assert "data: " in out and "first 20 steps of the seeded order (160 rows of 64" in out
    assert "data rank   tokens   attention" in out
    assert "warning[W0808]" in out and "--balance" in out
    code, js, _ = _meshc(capsys, "plan", str(spec_file), "--data", str(skewed), "--steps", "20", "--format", "json")
    before = json.loads(js)
    code, js, _ = _meshc(capsys, "plan", str(spec_file), "--data", str(skewed), "--steps", "20", "--balance",
                         "--format", "json")
    after = json.loads(js)
    b, a = before["plans"][0]["data"], after["plans"][0]["data"]
    assert b["attention_excess"] > DATA_SKEW_WARN and not b["balanced"] and a["balanced"]
    assert a["attention_excess"] < b["attention_excess"] / 2
    # Repacking moves the step's document pieces between rows, the same pieces: about the same work
    # in all (which piece ends a row, whose last id is no token, and the few it splits change it).
    assert a["attention_pairs"] == pytest.approx(b["attention_pairs"], rel=0.01)
    assert a["attention_flops"] == pytest.approx(b["attention_flops"], rel=0.01)
    assert a["step_s"] < b["step_s"] and a["step_s_even"] == pytest.approx(b["step_s_even"], rel=0.01)
    assert sum(b["attention_shares"]) == pytest.approx(1) and len(b["token_shares"]) == 4
    assert b["attention_flops"] < b["attention_flops_upper_bound"]
    assert [d["code"] for d in before["diagnostics"]].count("W0808") == 1
    # The rest of the report is the plan's own.
    plain = json.loads(_meshc(capsys, "plan", str(spec_file), "--format", "json")[1])
    b.pop("source")
    assert {k: v for k, v in before["plans"][0].items() if k != "data"} == plain["plans"][0]
    assert "data" not in plain["plans"][0]


def test_plan_data_without_a_document_mask_prices_every_row_over_seq(capsys: pytest.CaptureFixture[str],
                                                                       skewed: Path, tmp_path: Path) -> None:
    spec = tmp_path / "plain.mesh"
    spec.write_text(_spec(pack=False))
    code, js, _ = _meshc(capsys, "plan", str(spec), "--data", str(skewed), "--format", "json")
    d = json.loads(js)
    data = d["plans"][0]["data"]
    assert not data["document_mask"] and data["attention_excess"] == 0
    assert data["attention_shares"] == [0.25] * 4 and data["attention_share_of_upper_bound"] == 1
    assert data["step_s"] == data["step_s_upper_bound"]
    assert not [x for x in d["diagnostics"] if x["code"] == "W0808"]


def test_data_stats_with_a_plan_reports_each_ranks_share(capsys: pytest.CaptureFixture[str], skewed: Path,
                                                         spec_file: Path) -> None:
    code, out, _ = _meshc(capsys, "data-stats", str(skewed), "--plan", str(spec_file), "--steps", "20")
    assert code == 0
    assert "documents  400" in out  # the source's own statistics first
    assert "plan `p`: batch 8 x seq 64 over 4 data ranks on h100" in out
    assert "busiest rank's attention excess" in out and "warning[W0808]" in out
    code, out, _ = _meshc(capsys, "data-stats", str(skewed), "--plan", str(spec_file), "--steps", "20", "--balance")
    assert "balanced over the data ranks" in out


def test_plan_data_tokenizes_a_jsonl_into_the_cache(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     tok_dir: Path, spec_file: Path) -> None:
    from alice_corpus import ALICE

    src = tmp_path / "docs.jsonl"
    long_doc = " ".join(ALICE)
    src.write_text("".join(json.dumps({"text": long_doc if i % 10 == 0 else "Alice."}) + "\n" for i in range(200)))
    cache = tmp_path / "cache"
    args = ["plan", str(spec_file), "--data", str(src), "--tokenizer", str(tok_dir), "--data-cache", str(cache),
            "--format", "json"]
    code, js, _ = _meshc(capsys, *args)
    assert code == 0 and any(cache.iterdir())
    data: dict[str, Any] = json.loads(js)["plans"][0]["data"]
    assert data["document_mask"] and 0 < data["attention_share_of_upper_bound"] < 1
    assert data["documents"] > data["rows"]  # several documents a row


def test_plan_data_names_a_missing_tokenizer(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             spec_file: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "a"}\n')
    code, out, err = _meshc(capsys, "plan", str(spec_file), "--data", str(src), "--data-cache", str(tmp_path / "c"))
    assert code != 0 and not out
    assert "a jsonl source needs --tokenizer DIR" in err and "Traceback" not in err
