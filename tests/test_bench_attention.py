"""bench.attention at its smallest: it runs end to end, writes the JSON it promises, every mode agrees with the ring;
the model's formulas: equal compute in every mode, the transfer hidden exactly from the documented threshold on,
Ulysses' all-to-all volume independent of cp; MLA against GQA at equal attention parameters."""
import dataclasses
import json
import math
import re

import pytest

from bench import attention, attention_mla
from bench.plan.hardware import CLUSTERS
from models.flops import attention_params


def test_attention_benchmark_runs_and_the_modes_agree(tmp_path, capsys):
    out = tmp_path / "attention.json"
    attention.main(["--seq", "16", "--cp", "1", "2", "4", "--heads", "4", "--kv-heads", "1", "--head-dim", "4",
                    "--iters", "1", "--warmup", "0", "--hardware", "h100-nvlink", "--model-seq", "8192",
                    "--model-cp", "8", "--out", str(out), "--json"])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result  # --json: stdout is that one object
    rows = {(r["cp"], r["mode"]): r for r in result["measured"]}
    assert list(rows) == [(1, "dense"), (2, "ring"), (2, "allgather"), (2, "a2a"), (4, "ring"), (4, "allgather"),
                          (4, "a2a"), (4, "a2a+ring")]
    for row in rows.values():
        assert row["seq"] == 16 and row["ms"] > 0 and row["saved_mib"] > 0 and row["largest_mib"] > 0
        assert row["peak_mib"] == pytest.approx(row["saved_mib"] + row["largest_mib"])
        assert row["vs_dense"] == pytest.approx(row["ms"] / rows[1, "dense"]["ms"])
    for (cp, mode), row in rows.items():
        if cp > 1:
            assert row["err"] < 1e-5 and (row["vs_ring"] is None) == (mode == "ring")
            assert mode == "ring" or row["vs_ring"] < 1e-5
    assert rows[1, "dense"]["err"] is None and rows[1, "dense"]["vs_ring"] is None
    # a rank saves its share of q, k, v, out (ring) or the gathered k, v too (allgather); dense the whole sequence
    assert rows[2, "ring"]["saved_mib"] < rows[2, "allgather"]["saved_mib"] < rows[1, "dense"]["saved_mib"]
    assert [(r["hardware"], r["seq"], r["cp"], r["heads"], r["n"]) for r in result["model"]] == [
        ("h100-nvlink", 8192, 8, "32/32", 1024), ("h100-nvlink", 8192, 8, "32/8", 1024)]
    for row in result["model"]:
        times = {mode: row[f"{mode.replace('+', '_')}_ms"] for mode in attention.MODES}
        assert row["winner"] == min(times, key=times.get) and min(times.values()) > row["compute_ms"] > 0
    # MLA vs GQA: modelled at 32/8 heads of 128 (h 4096), measured at 4/1 heads of 4 (h 16) over 16 tokens
    latent = result["mla_vs_gqa"]
    assert [r["attention"] for r in latent["model"]] == [r["attention"] for r in latent["measured"]] == ["GQA", "MLA"]
    for row in latent["model"] + latent["measured"]:
        assert row["saved_kib_per_token"] > 0 and row.get("ms", 1) > 0 and row.get("modelled_ms", 1) > 0
    gqa, mla = latent["model"]
    assert abs(mla["params_m"] - gqa["params_m"]) < 0.02 * gqa["params_m"]
    assert mla["kv_cache_bytes"] < gqa["kv_cache_bytes"] == 2 * 8 * 128 * 2


def test_mla_is_scaled_to_the_gqa_layer_parameters():
    """DeepSeek-V3's latent ranks scaled to h (1536/7168·h, 512/7168·h in multiples of 32), its head widths kept, the
    head count the one closest in attention weights; FLOPs per token 6·weights + 6·heads·(192 + 128)·S, as
    models.flops counts; the KV cache the latent and the RoPE key."""
    gqa = attention_mla.gqa_config(4096, 32, 8, 128, seq=8192)
    mla = attention_mla.mla_config(gqa)
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim) == (864, 288, 192, 128)
    weights = [attention_params(mla.replace(num_heads=n, num_kv_heads=None))
               for n in (mla.num_heads - 1, mla.num_heads + 1)]
    assert all(abs(w - attention_params(gqa)) >= abs(attention_params(mla) - attention_params(gqa)) for w in weights)
    row = attention_mla.compared_row("MLA", mla, 8192, CLUSTERS["h100-sxm"])
    assert row["gflops_per_token"] * 1e9 == pytest.approx(6 * attention_params(mla) + 6 * mla.num_heads * 320 * 8192)
    assert row["kv_cache_bytes"] == 2 * (288 + 64)


def test_model_compute_is_the_same_in_both_modes_and_the_transfer_hides_from_the_threshold():
    hw = attention.PROFILES["h100-nvlink"]
    free = dataclasses.replace(hw, link=math.inf, hbm=math.inf)  # communication and merging cost nothing
    row = attention.model_row(free, 32768, 8, 32, 8, 128, latency=0.0)
    for mode in ("ring", "allgather", "a2a", "a2a_ring"):
        assert row[f"{mode}_ms"] == pytest.approx(row["compute_ms"]), mode
    for kv_heads in (32, 8):
        threshold = kv_heads / 32 * hw.element_size * hw.flops / hw.link  # (Hkv/H)·e·C/W tokens per rank
        below, above = (attention.model_row(hw, 8 * n, 8, 32, kv_heads, 128, latency=0.0)
                        for n in (math.floor(0.99 * threshold), math.ceil(1.01 * threshold)))
        assert (below["hidden"], above["hidden"]) == (False, True)
        assert below["hide_from_n"] == pytest.approx(threshold)


def test_a_cp_group_larger_than_a_node_is_priced_at_each_gpus_nic():
    """cp = 16 on 8-GPU NVLink nodes: the KV messages and the all-to-alls cross nodes at each GPU's NIC (inter_node),
    as bench.intensity and bench.plan price a group past the node (it was charged at NVLink): the same as the
    h100-ib-gpu profile, whose a2a+ring also keeps its all-to-alls inside the node."""
    hw = attention.PROFILES["h100-nvlink"]
    n = 8192 // 16
    inside, across = (attention.model_row(hw, 8192, cp, 32, 32, 128, latency=0.0) for cp in (8, 16))
    assert inside["kv_us"] == pytest.approx(1e6 * 2 * 32 * 1024 * 128 * hw.element_size / hw.link)
    assert across["kv_us"] == pytest.approx(1e6 * 2 * 32 * n * 128 * hw.element_size / hw.inter_node)
    assert across["hide_from_n"] == pytest.approx(hw.element_size * hw.flops / hw.inter_node)
    ib = attention.PROFILES["h100-ib-gpu"]  # the same GPUs, every message over its NIC
    assert across["a2a_ms"] == pytest.approx(attention.model_row(ib, 8192, 16, 32, 32, 128, latency=0.0)["a2a_ms"])
    assert across["a2a_ring_ms"] == pytest.approx(attention.model_row(ib, 8192, 16, 32, 32, 128, latency=0.0)
                                                  ["a2a_ring_ms"])


def test_ulysses_moves_the_same_bytes_per_rank_whatever_cp():
    """a2a: 4 all-to-alls each way of [n = S/cp]-token tensors, (cp−1)/cp of each leaving the rank: at a fixed S a
    rank's volume falls as (cp−1)/cp², where the ring's (cp−1) KV messages of n tokens stay about constant."""
    hw = dataclasses.replace(attention.PROFILES["h100-nvlink"], flops=math.inf, hbm=math.inf,  # communication only
                             gpus_per_node=32)  # (one NVLink domain)
    rows = [attention.model_row(hw, 65536, cp, 32, 32, 128, latency=0.0) for cp in (8, 16, 32)]
    volume = [2 * 4 * 32 * (65536 // cp) * 128 * 2 * (cp - 1) / cp / hw.link * 1e3 for cp in (8, 16, 32)]
    assert [r["a2a_ms"] for r in rows] == pytest.approx(volume)
    assert rows[0]["a2a_ms"] / rows[2]["a2a_ms"] == pytest.approx(4 * (7 / 8) / (31 / 32))


@pytest.mark.parametrize("flags,message", [
    (["--seq", "12", "--cp", "4"], r"--seq 12 is not divisible by 2·cp = 8"),
    (["--heads", "4", "--kv-heads", "3"], r"--heads 4 .* multiples of --kv-heads 3"),
    (["--iters", "0"], r"argument --iters: 0 is not >= 1"),
])
def test_impossible_arguments_are_one_usage_error(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        attention.main(flags)
    assert exit_info.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_a_mode_a_cp_size_cannot_run_is_named_with_why():
    """--cp 3 with 4 heads: a2a and a2a+ring are not measured; the run says why instead of leaving them out silently."""
    assert attention.left_out(3, 4, 4, 2) == [
        "cp=3: a2a left out (--heads 4 / --kv-heads 4 do not split over 3 ranks)",
        "cp=3: a2a+ring left out (cp is not a larger multiple of --a2a-size 2)"]
    assert attention.left_out(4, 4, 4, 2) == []
