"""bench.attention at its smallest: it runs end to end, writes the JSON it promises, ring and all-gather agree; the
model's formulas: equal compute in both modes, the transfer hidden exactly from the documented threshold on."""
import dataclasses
import json
import math
import re

import pytest

from bench import attention


def test_attention_benchmark_runs_and_the_modes_agree(tmp_path, capsys):
    out = tmp_path / "attention.json"
    attention.main(["--seq", "16", "--cp", "1", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "4",
                    "--iters", "1", "--warmup", "0", "--hardware", "h100-nvlink", "--model-seq", "8192",
                    "--model-cp", "8", "--out", str(out), "--json"])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result  # --json: stdout is that one object
    rows = {(r["cp"], r["mode"]): r for r in result["measured"]}
    assert list(rows) == [(1, "dense"), (2, "ring"), (2, "allgather")]
    for row in rows.values():
        assert row["seq"] == 16 and row["ms"] > 0 and row["saved_mib"] > 0 and row["largest_mib"] > 0
        assert row["peak_mib"] == pytest.approx(row["saved_mib"] + row["largest_mib"])
        assert row["vs_dense"] == pytest.approx(row["ms"] / rows[1, "dense"]["ms"])
    for mode in ("ring", "allgather"):
        assert rows[2, mode]["err"] < 1e-5 and rows[2, mode]["ring_vs_allgather"] < 1e-5
    assert rows[1, "dense"]["err"] is None and rows[1, "dense"]["ring_vs_allgather"] is None
    # a rank saves its share of q, k, v, out (ring) or the gathered k, v too (allgather); dense the whole sequence
    assert rows[2, "ring"]["saved_mib"] < rows[2, "allgather"]["saved_mib"] < rows[1, "dense"]["saved_mib"]
    assert [(r["hardware"], r["seq"], r["cp"], r["heads"], r["n"]) for r in result["model"]] == [
        ("h100-nvlink", 8192, 8, "32/32", 1024), ("h100-nvlink", 8192, 8, "32/8", 1024)]
    for row in result["model"]:
        assert row["winner"] == ("ring" if row["ring_ms"] < row["allgather_ms"] else "allgather")
        assert min(row["ring_ms"], row["allgather_ms"]) > row["compute_ms"] > 0


def test_model_compute_is_the_same_in_both_modes_and_the_transfer_hides_from_the_threshold():
    hw = attention.PROFILES["h100-nvlink"]
    free = dataclasses.replace(hw, link=math.inf, hbm=math.inf)  # communication and merging cost nothing
    row = attention.model_row(free, 32768, 8, 32, 8, 128, latency=0.0)
    assert row["ring_ms"] == pytest.approx(row["compute_ms"])
    assert row["allgather_ms"] == pytest.approx(row["compute_ms"])
    for kv_heads in (32, 8):
        threshold = kv_heads / 32 * hw.element_size * hw.flops / hw.link  # (Hkv/H)·e·C/W tokens per rank
        below, above = (attention.model_row(hw, 8 * n, 8, 32, kv_heads, 128, latency=0.0)
                        for n in (math.floor(0.99 * threshold), math.ceil(1.01 * threshold)))
        assert (below["hidden"], above["hidden"]) == (False, True)
        assert below["hide_from_n"] == pytest.approx(threshold)


@pytest.mark.parametrize("flags,message", [
    (["--seq", "12", "--cp", "4"], r"--seq 12 is not divisible by 2·cp = 8"),
    (["--heads", "4", "--kv-heads", "3"], r"--heads 4 .* multiples of --kv-heads 3"),
    (["--iters", "0"], r"argument --iters: 0 is not >= 1"),
])
def test_impossible_arguments_are_one_usage_error(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        attention.main(flags)
    assert exit_info.value.code == 2 and re.search(message, capsys.readouterr().err)
