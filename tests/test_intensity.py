"""bench.roofline's arithmetic against hand-computed cases, its collective formulas against the messages the real
Column -> Row layers send (counted at the c10d dispatch, TP = 2 and 4, with and without SP), the TP recommendation on
the scaling book's examples, and `python -m bench.intensity --quick` end to end."""
import csv
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tp
from bench import intensity
from bench import roofline as rl
from tp.testing import distributed

H100 = rl.HARDWARE["h100-nvlink"]


# ---- GEMM arithmetic ------------------------------------------------------------------------------------------------


def test_gemm_flops_bytes_intensity_by_hand():
    g = rl.Gemm("fc1", "fwd", 2, 3, 4)
    assert g.flops == 2 * 2 * 3 * 4 == 48
    assert g.bytes(2) == 2 * (2 * 3 + 3 * 4 + 2 * 4) == 52
    assert g.intensity(2) == pytest.approx(48 / 52)
    assert g.intensity(4) == pytest.approx(48 / 104)
    # GPT MLP fc1 shard D=4096, F=16384, TP=8, 4096 tokens: 4096·4096·2048 / (4096·4096 + 2·4096·2048) = 1024
    shard = rl.Gemm("fc1", "fwd", 4096, 4096, 2048)
    assert shard.flops == 68_719_476_736
    assert shard.bytes(2) == 67_108_864
    assert shard.intensity(2) == 1024


def test_roofline_time_and_ridge():
    assert H100.ridge == pytest.approx(295.2, abs=0.1)  # 989e12 / 3.35e12
    assert H100.flops_per_link_byte == pytest.approx(2197.8, abs=0.1)  # C/W ≈ 2200
    assert rl.HARDWARE["h100-ib"].flops_per_link_byte == pytest.approx(2472.5)  # REFERENCE.md: ≈ 2475 across nodes
    decode = rl.Gemm("fc1", "fwd", 1, 4096, 4096)  # one token: reads the whole weight for 2 FLOPs per element
    assert decode.intensity(2) < H100.ridge
    assert decode.time(H100) == decode.bytes(2) / H100.hbm
    big = rl.Gemm("fc1", "fwd", 4096, 4096, 4096)
    assert big.intensity(2) > H100.ridge
    assert big.time(H100) == big.flops / H100.flops


def test_shards_column_divides_n_row_divides_k():
    shape = rl.Shape(hidden=6, ffn=20, tokens=5)
    dims = [(g.layer, g.phase, g.m, g.k, g.n) for g in rl.mlp_gemms(shape, 2)]
    assert dims == [("fc1", "fwd", 5, 6, 10), ("fc1", "dgrad", 5, 10, 6), ("fc1", "wgrad", 10, 5, 6),
                    ("fc2", "fwd", 5, 10, 6), ("fc2", "dgrad", 5, 6, 10), ("fc2", "wgrad", 6, 5, 10)]
    swiglu = rl.mlp_gemms(rl.Shape(hidden=6, ffn=20, tokens=5, mlp="swiglu"), 2)
    assert (swiglu[0].m, swiglu[0].k, swiglu[0].n) == (5, 6, 20)  # fused gate/up: 2·F/TP
    attn = [(g.layer, g.phase, g.m, g.k, g.n) for g in rl.attention_gemms(shape, 2)]
    assert attn[0] == ("qkv", "fwd", 5, 6, 9) and attn[3] == ("proj", "fwd", 5, 3, 6)


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_per_rank_flops_add_up_to_the_dense_layer(mlp):
    shape = rl.Shape(hidden=64, ffn=192, tokens=7, mlp=mlp)
    dense = sum(g.flops for g in rl.mlp_gemms(shape, 1) + rl.attention_gemms(shape, 1))
    for degree in (2, 4, 8, 16, 32, 64):
        assert degree * sum(g.flops for g in rl.mlp_gemms(shape, degree) + rl.attention_gemms(shape, degree)) == dense


def test_ring_wire_bytes_by_hand():
    assert rl.Collective(rl.ALL_REDUCE, "fwd", 1000).wire_bytes(4) == 1500  # 2·3/4·n
    assert rl.Collective(rl.ALL_GATHER, "fwd", 1000).wire_bytes(4) == 750
    assert rl.Collective(rl.REDUCE_SCATTER, "fwd", 1000).wire_bytes(2) == 500
    assert rl.pair_collectives(8, 16, 1, 2, sequence_parallel=True) == []


def test_default_ffn_sizes():
    assert rl.default_ffn(4096, "gelu") == 16384
    assert rl.default_ffn(4096, "swiglu") == 11008  # Llama-7B's
    with pytest.raises(ValueError, match="mlp must be"):
        rl.Shape(64, 256, 8, mlp="relu")


# ---- collective formulas vs the messages the layers send ------------------------------------------------------------


class CountCollectives(TorchDispatchMode):
    """Records (kind, bytes of the full tensor) for each c10d collective dispatched on this rank."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.allreduce_.default:
            self.seen.append((rl.ALL_REDUCE, sum(t.numel() * t.element_size() for t in args[0])))
        elif func is torch.ops.c10d._allgather_base_.default:  # (output, input, ...)
            self.seen.append((rl.ALL_GATHER, args[0].numel() * args[0].element_size()))
        elif func is torch.ops.c10d._reduce_scatter_base_.default:  # (output, input, ...)
            self.seen.append((rl.REDUCE_SCATTER, args[1].numel() * args[1].element_size()))
        return func(*args, **(kwargs or {}))


def _counted(fn):
    with CountCollectives() as mode:
        fn()
    return sorted(mode.seen)


def _formula(collectives, phase):
    return sorted((c.kind, c.size) for c in collectives if c.phase == phase)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp_size", [2, 4])
@distributed(world_size=4)
def test_collective_bytes_match_the_layers(tp_size, sequence_parallel):
    mesh = tp.init_mesh(tp=tp_size)
    tokens, hidden, ffn, dtype = 4 * 3, 8, 12, torch.float64  # [s, b] = [12, 1]; SP keeps s/tp per rank
    torch.manual_seed(0)
    fc1 = tp.ColumnParallelLinear(hidden, ffn, activation="gelu", sequence_parallel=sequence_parallel, dtype=dtype)
    # No row bias: under SP its gradient sync (e·D bytes, parameters not activations) is outside the model.
    fc2 = tp.RowParallelLinear(ffn, hidden, bias=False, sequence_parallel=sequence_parallel, dtype=dtype)
    local_tokens = tokens // tp_size if sequence_parallel else tokens
    x = torch.randn(local_tokens, 1, hidden, dtype=dtype, requires_grad=True)
    out = []
    fwd = _counted(lambda: out.append(fc2(fc1(x))))
    bwd = _counted(lambda: out[0].backward(torch.ones_like(out[0])))
    expected = rl.pair_collectives(tokens, hidden, mesh.tp_size, 8, sequence_parallel=sequence_parallel)
    assert fwd == _formula(expected, "fwd"), (fwd, expected)
    assert bwd == _formula(expected, "bwd"), (bwd, expected)
    moved = sum(rl.Collective(kind, "", size).wire_bytes(tp_size) for kind, size in fwd + bwd)
    assert moved == sum(c.wire_bytes(tp_size) for c in expected)
    assert moved == (5 if sequence_parallel else 4) * (tp_size - 1) / tp_size * 8 * tokens * hidden


# ---- the recommendation -------------------------------------------------------------------------------------------


def _big(ffn, mlp="gelu"):
    return rl.Shape(hidden=8192, ffn=ffn, tokens=16384, mlp=mlp)  # compute-bound local GEMMs at every TP <= 16


def test_scaling_book_examples_on_h100_nvlink():
    # F/Y = 1792 < C/W ≈ 2198: communication-bound at TP=8; F = 28672 gives 3584: not.
    assert rl.tp_model(_big(14336), 8, H100)["communication_bound"]
    assert not rl.tp_model(_big(28672), 8, H100)["communication_bound"]
    rec = rl.recommendation(_big(14336), H100)
    assert (rec["max_tp_overlapped"], rec["max_tp_serial"]) == (4, 4)
    rec = rl.recommendation(_big(28672), H100)
    assert (rec["max_tp_overlapped"], rec["max_tp_serial"]) == (8, 8)
    assert rec["f_over_tp_threshold"] == pytest.approx(989e12 / 450e9)


def test_rule_is_exact_at_the_threshold():
    # F/8 = 2198 >= 2197.8 fits; F/8 = 2197 does not (compute-bound GEMMs: T_math = FLOPs / C exactly).
    at = rl.tp_model(_big(8 * 2198), 8, H100)
    below = rl.tp_model(_big(8 * 2197), 8, H100)
    assert at["mlp_fwd_compute_s"] == at["mlp_fwd_flops"] / H100.flops
    assert not at["communication_bound"] and below["communication_bound"]


def test_swiglu_three_matrices_move_the_limit():
    # Same F as the book's 14336, but gate + up + down: 1.5x the FLOPs for the same collectives.
    assert not rl.tp_model(_big(14336, "swiglu"), 8, H100)["communication_bound"]
    assert rl.recommendation(_big(14336, "swiglu"), H100)["max_tp_overlapped"] == 8


def test_other_profiles_and_efficiencies():
    a100, ib = rl.HARDWARE["a100-nvlink"], rl.HARDWARE["h100-ib"]
    assert a100.flops_per_link_byte == pytest.approx(1040)  # 312e12 / 300e9: TP=8 fine down to F = 8320
    assert rl.recommendation(_big(8 * 1040), a100)["max_tp_overlapped"] == 8
    assert rl.recommendation(_big(8 * 2300), ib)["max_tp_overlapped"] == 4  # 2300 < 2472.5
    rows = {d: rl.tp_model(_big(14336), d, H100) for d in (4, 8)}
    assert rows[4]["efficiency_overlapped"] == 1 and rows[4]["efficiency_serial"] >= 0.5
    assert rows[8]["efficiency_overlapped"] < 1 and rows[8]["efficiency_serial"] < 0.5


# ---- the command ----------------------------------------------------------------------------------------------------


def test_quick_end_to_end_writes_its_files(tmp_path):
    result = intensity.main([
        "--quick", "--hardware", "cpu-measured", "--hidden", "256", "--tokens", "64", "--measure-tp", "2",
        "--max-gflop", "0.002", "--peak-size", "128", "--bandwidth-mb", "8", "--min-seconds", "0.001",
        "--out", str(tmp_path)])
    measured = result["measured"]
    assert measured["peak_flops"] > 0 and measured["bandwidth"] > 0 and measured["link"] > 0
    with open(tmp_path / "gemms.csv") as f:
        gemms = list(csv.DictReader(f))
    assert len(gemms) == 7 * 12  # TP 1..64 x (MLP + attention projections) x (fwd, dgrad, wgrad)
    timed = [r for r in gemms if r["measured_flops"]]
    assert timed and all(int(r["flops"]) <= 0.002e9 and float(r["measured_flops"]) > 0 for r in timed)
    assert all(not r["measured_flops"] for r in gemms if int(r["flops"]) > 0.002e9)
    with open(tmp_path / "collectives.csv") as f:
        timed = list(csv.DictReader(f))
    assert sorted(r["kind"] for r in timed) == sorted([rl.ALL_REDUCE, rl.ALL_GATHER, rl.REDUCE_SCATTER])
    assert all(r["elements"] == str(64 * 256) and r["tp"] == "2" and float(r["seconds"]) > 0 for r in timed)
    with open(tmp_path / "tp.csv") as f:
        tps = list(csv.DictReader(f))
    assert [int(r["tp"]) for r in tps] == list(rl.TP_DEGREES)
    assert float(tps[1]["measured_all_reduce_s"]) > 0 and not tps[2]["measured_all_reduce_s"]
    rec = json.loads((tmp_path / "recommendation.json").read_text())
    assert rec["hardware"] == "cpu-measured" and rec["max_tp_overlapped"] in rl.TP_DEGREES
    assert rec["max_tp_serial"] == rec["max_tp_overlapped"]
    assert json.loads((tmp_path / "intensity.json").read_text())["meta"]["hardware"]["link"] == measured["link"]
    assert (tmp_path / "intensity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="cpu-measured needs measurements"):
        intensity.main(["--no-measure", "--hardware", "cpu-measured", "--hidden", "64", "--tokens", "8"])
    with pytest.raises(ValueError, match="--ffn 512 needs --hidden"):
        intensity.main(["--no-measure", "--ffn", "512"])


def test_recommendation_takes_the_largest_token_count_whatever_the_order():
    ordered = intensity.main(["--no-measure", "--hidden", "1024", "--tokens", "16", "16384"])["recommendations"]
    reversed_ = intensity.main(["--no-measure", "--hidden", "1024", "--tokens", "16384", "16"])["recommendations"]
    assert reversed_ == ordered and ordered[0]["tokens"] == 16384


def test_max_gflop_zero_times_no_gemm(tmp_path):
    result = intensity.main(["--quick", "--hardware", "cpu-measured", "--hidden", "64", "--tokens", "8",
                             "--measure-tp", "2", "--max-gflop", "0", "--peak-size", "64", "--bandwidth-mb", "1",
                             "--min-seconds", "0.001"])
    assert result["measured"]["gemms"] == {}


@pytest.mark.parametrize("flags,message", [
    (["--measure-tp", "1"], r"--measure-tp needs degrees >= 2, got \[1\]"),
    (["--measure-tp", "2", "3"], r"--measure-tp 3 does not divide the message of 8 tokens x hidden 64"),
    (["--hidden", "0"], r"--hidden 0 must be >= 1"),
    (["--tokens", "0"], r"--tokens 0 must be >= 1"),
])
def test_bad_measurement_arguments_are_named_before_measuring(flags, message):
    with pytest.raises(ValueError, match=message):
        intensity.main(["--quick", "--hidden", "64", "--tokens", "8", *flags])
