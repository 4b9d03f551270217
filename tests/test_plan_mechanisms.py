"""bench.plan's mechanisms against hand computations: the GEMM rate by shape (tiles and waves), attention rates by
sequence length, Megatron's uneven pipeline splits and the bubble the schedule simulator gives them, recompute
modules (memory, time, FLOPs), the software registry on the command line, progress of a long search. (MoE costs:
tests/test_moe_plan.py; FSDP2's resharding peak against a CPU run: tests/test_memory.py.)"""
import json
import math
from dataclasses import replace

import pytest

import models
from bench import roofline as rl
from bench.plan import activations, attention_time, gemm, memory, pipeline, recompute, search, stages
from bench.plan import cli as plan
from bench.plan import hardware as hw
from bench.plan import step_time as pm
from tests.helpers import quiet
from tp.pipeline import schedules

UNIT = hw.Cluster("unit", rl.Hardware("unit", flops=1.0, hbm=1.0, link=1.0, source="test", gpus_per_node=8,
                                      inter_node=1.0),
                  memory=1e30, reserved=0.0, gemm_efficiency=0.5, comm_efficiency=1.0, attention_efficiency=1.0,
                  op_overhead=0.0, source="test", sms=4)


def test_gemm_rate_by_tiles_and_waves_by_hand():
    """128 × 128 output tiles in waves over the SMs: a 200 × 128 output is 2 tiles on 4 SMs (one wave of 4 slots),
    useful 200·128 / (4·128²); three 100 × 300 groups are 9 tiles, 3 waves; a whole wave computes at η."""
    assert gemm.useful_fraction(200, 128, 4) == pytest.approx(200 * 128 / (4 * 128 * 128))
    assert gemm.useful_fraction(100, 300, 4, groups=3) == pytest.approx(3 * 100 * 300 / (3 * 4 * 128 * 128))
    assert gemm.useful_fraction(512, 128, 4) == 1.0 and gemm.useful_fraction(100, 100, 0) == 1.0
    full = rl.Gemm("x", "fwd", 512, 1024, 128)  # 4 tiles, one full wave: FLOPs at η = 0.5 (bytes / HBM are less)
    assert gemm.gemm_time(full, UNIT, 2) == pytest.approx(2 * 512 * 1024 * 128 / 0.5)
    half = rl.Gemm("x", "fwd", 256, 1024, 128)  # 2 tiles on 4 SMs: the same wave, half of it idle
    assert gemm.gemm_time(half, UNIT, 2) == pytest.approx(gemm.gemm_time(full, UNIT, 2))


def test_attention_rate_by_sequence_length_by_hand():
    """Measured (s, TFLOP/s) points interpolate linearly in log s: halfway between 4096 and 8192 (s = 4096·√2)
    the rate is halfway; beyond the points flat. On h100-sxm cuDNN's backward at 8k is 518 TFLOP/s."""
    points = ((4096, 500), (8192, 600))
    assert attention_time.rate_at(points, round(4096 * 2 ** 0.5)) == pytest.approx(550e12, rel=1e-4)
    assert attention_time.rate_at(points, 1024) == 500e12 and attention_time.rate_at(points, 65536) == 600e12
    h100 = hw.CLUSTERS["h100-sxm"]
    config = models.GPTConfig(**models.config.MODELS["llama3-8b"])
    p = pm.Plan(1, 1, 1, 1, 1, 1)
    fwd, bwd = attention_time.attention_times(config, p, 8192, h100, pm.NEMO_2024, 2)
    flops = 2 * 32 * 8192 * 8192 * 128
    assert (fwd, bwd) == (pytest.approx(flops / 614e12), pytest.approx(2.5 * flops / 518e12))


def test_megatron_uneven_splits_by_hand():
    """get_num_layers_to_build's rules: Llama 3 405B's 126 layers on 16 stages with the embedding and loss counted
    (7, 8 × 14, 7) — as first = last = 7; with vp 2 the chunks of 4, one fewer in the first and the last;
    DeepSeek-V3's 61 layers at pp 16 with first 4 and last 1: 4 in each middle stage."""
    accounted = stages.StageSplit(embedding=True, loss=True)
    assert stages.layer_counts(126, 16, 1, accounted) == (7,) + (8,) * 14 + (7,)
    assert stages.layer_counts(126, 16, 1, stages.StageSplit(first=7, last=7)) == (7,) + (8,) * 14 + (7,)
    assert stages.layer_counts(126, 16, 2, accounted) == (3,) + (4,) * 30 + (3,)
    assert stages.layer_counts(61, 16, 1, stages.StageSplit(first=4, last=1)) == (4,) + (4,) * 14 + (1,)
    assert stages.layer_counts(10, 4, 1) == (3, 3, 2, 2)  # the job's even split
    chunks = stages.stage_chunks(126, 16, 0, 2, accounted)  # rank 0: virtual stages 0 and 16
    assert chunks == [(0, 3, True, False), (3 + 15 * 4, 3 + 16 * 4, False, False)]
    with pytest.raises(ValueError, match=r"= 128 is not divisible by pp\*virtual_stages = 16\*3"):
        stages.layer_counts(126, 16, 3, accounted)


def test_the_uneven_stage_bubble_comes_from_the_simulator():
    """1F1B over 2 stages, 2 micro-batches, stage 0 costing (F, B) = (1, 2) and stage 1 (2, 4): by hand rank 1 runs
    F0 1-3, B0 3-7, F1 7-9, B1 9-13; rank 0 F0 0-1, F1 1-2, B0 7-9, B1 13-15: a span of 15. Beyond 2p micro-batches
    the span grows by its last p's slope, equal here to the simulated span."""
    costs = ((1.0, 2.0, 0.0), (2.0, 4.0, 0.0))
    assert schedules.simulate(schedules.build("1f1b", 2, 2), stage_costs=costs).span == 15.0
    assert pipeline.span("1f1b", 2, 1, 2, costs) == 15.0
    exact = schedules.simulate(schedules.build("1f1b", 2, 10), stage_costs=costs).span
    assert pipeline.span("1f1b", 2, 1, 10, costs) == pytest.approx(exact)
    uniform = schedules.simulate(schedules.build("interleaved", 2, 4, 2), costs=(2.0, 4.0, 0.0))
    per_stage = schedules.simulate(schedules.build("interleaved", 2, 4, 2), stage_costs=[(1.0, 2.0, 0.0)] * 4)
    assert per_stage.span == uniform.span  # a rank's cost split over V: the unit-cost simulator unchanged
    with pytest.raises(schedules.ScheduleError, match="for each of the 4 virtual stages"):
        schedules.simulate(schedules.build("interleaved", 2, 4, 2), stage_costs=costs)


def test_the_step_of_an_uneven_split_is_the_simulated_span():
    """A plan with Megatron's embedding and loss accounting: its step is the simulator's span of its virtual
    stages' own costs plus the dp and optimizer terms, and the bubble what the span leaves over the slowest rank."""
    config = models.GPTConfig(**(models.config.PRESETS["small"] | {"num_layers": 6}))
    p = pm.Plan(1, 1, 2, 2, 1, 1, split=stages.StageSplit(embedding=True, loss=True))
    out = pm.step_time(config, p, seq_len=64, global_batch_size=8, cluster=UNIT)
    counts = stages.layer_counts(6, 2, 2, p.split)
    assert counts == (1, 2, 2, 1)
    starts = [0, 1, 3, 5]
    costs = []
    for s, n in enumerate(counts):
        t = pm.chunk_times(config, p, 64, UNIT, pm.OURS, (starts[s], starts[s] + n, s == 0, s == 3))
        p2p = pm._p2p_time(config, p, 64, UNIT, pm.OURS)
        costs.append((t.fwd + p2p, t.bwd + t.recompute + p2p, t.wgrad))
    span = pipeline.span("interleaved", 2, 2, 8, costs)
    assert out["step_s"] == pytest.approx(span + out["breakdown"]["dp_comm"] + out["breakdown"]["optimizer"])
    assert out["breakdown"]["bubble"] > 0


def test_recompute_modules_by_hand():
    """layernorm keeps each norm's input only (e·T'·h, here 2·64·64 per norm instead of this package's fp32 copy,
    rstd, normed and weighted outputs); mlp keeps nothing of the MLP; moe_act drops the experts' activation; the
    time repeats the norms' forward bytes; mlp's FLOPs are its forward GEMMs'."""
    cfg = models.GPTConfig(**models.config.PRESETS["tiny"])
    shape = dict(tp=1, micro_batch_size=1, seq_len=64, sequence_parallel=False, precision="bf16")
    base = memory.layer_activation_bytes(cfg, recompute="none", **shape)
    norm = activations.norm_activation_bytes(cfg, 64, "bf16")
    assert base - memory.layer_activation_bytes(cfg, recompute="layernorm", **shape) == 2 * (norm - 2 * 64 * 64)
    mlp = 2 * 64 * (2 * 192 + 192)  # SwiGLU pre-activation (2F) and activation (F), bf16
    assert base - memory.layer_activation_bytes(cfg, recompute="mlp", **shape) == mlp
    moe = models.GPTConfig(**models.config.PRESETS["tiny-moe"])
    slots = 64 * 2
    dropped = memory.layer_activation_bytes(moe, recompute="none", **shape) - memory.layer_activation_bytes(
        moe, recompute="moe_act", **shape)
    assert dropped == slots * 2 * 96  # each slot's activation [F] in bf16
    assert pm.recompute_flops_per_token(cfg, 64, "mlp") == 2 * 3 * 64 * 192 * 4
    assert pm.recompute_flops_per_token(cfg, 64, "layernorm+moe_act") == 0
    assert pm.recompute_flops_per_token(cfg, 64, "core_attn") == pm.recompute_flops_per_token(cfg, 64, "selective")
    p = pm.Plan(1, 1, 1, 1, 1, 1)
    t = {r: pm.step_time(cfg, replace(p, recompute=r), seq_len=64, global_batch_size=1, cluster=UNIT)
         for r in ("none", "layernorm")}
    norm_bytes = 2 * 64 * 64 * (4 * 2 + 20)  # RMSNorm ×2, eager: (4e + 20) bytes per element
    assert t["layernorm"]["breakdown"]["recompute"] == pytest.approx(4 * norm_bytes / UNIT.device.hbm)
    assert recompute.parse("layernorm+moe_act") == "layernorm+moe_act"
    with pytest.raises(ValueError, match="names a module twice"):
        recompute.parse("mlp+mlp")


def test_recompute_module_names_are_megatrons_and_the_jobs():
    """The planner's module names are Megatron-Core's (--recompute-modules), the job's very registry."""
    assert set(recompute.MODULES) >= {"core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts"}
    assert tuple(models.recompute.MODULES) == recompute.MODULES


def _run(capsys, *argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, quiet(out.err)


def test_uneven_splits_and_any_vp_the_layers_allow_on_the_cli(capsys):
    """A 4-layer model at pp 2: vp 3 only exists with the embedding and loss accounted ((4 + 2)/2 = 3 per rank);
    --fix pins it and the table names the split; first/last splits by --fix too."""
    small = ["--gpus", "2", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "4", "--json"]
    code, out, err = _run(capsys, *small, "--fix", "pp=2,vp=3")
    plans = json.loads(out)["plans"]
    assert code == 0 and plans and {(p["vp"], p["split"]) for p in plans} == {(3, "embedding+loss")}, err
    code, out, _ = _run(capsys, *small, "--fix", "pp=2,first_layers=1,last_layers=3")
    assert code == 0 and {p["split"] for p in json.loads(out)["plans"]} == {"first1,last3"}
    code, out, _ = _run(capsys, *small[:-1], "--fix", "pp=2,vp=3", "--top", "2")
    header = out.splitlines()[1]
    assert code == 0 and "split" in header.split("|")[4] and "embedding+loss" in out


def test_software_is_named_on_the_cli(capsys):
    """--software prices another implementation and says so; its optimizer's bytes move the memory."""
    flags = ["--gpus", "8", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "16", "--fix",
             "tp=1,pp=1,mbs=1,dp_mode=zero1,recompute=none", "--top", "1"]
    code, out, _ = _run(capsys, *flags, "--software", "megatron-core")
    assert code == 0 and "priced as Megatron-Core (TE)" in out
    code, out, _ = _run(capsys, *flags)
    assert code == 0 and "priced as" not in out


def test_a_long_search_reports_progress(monkeypatch):
    """Every PROGRESS_EVERY seconds (here 0) the search calls back with what it has done."""
    monkeypatch.setattr(search, "PROGRESS_EVERY", 0.0)
    calls = []
    cfg = models.GPTConfig(**models.config.PRESETS["tiny"])
    rows, _, count = search.search(cfg, gpus=2, seq_len=64, global_batch_size=4, cluster=hw.CLUSTERS["h100-sxm"],
                                   progress=lambda *a: calls.append(a))
    assert calls and calls[-1][0] == count == calls[-1][1] and calls[-1][2] == len(rows)
    assert math.isfinite(calls[-1][3])
