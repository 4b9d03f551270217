"""bench.plan: the step-time model's closed forms against hand-computed cases and the pipeline simulator, its
totals, the published-run validation (every figure within the issue's 20 %, the calibrated numbers a minimum), and
the command line on a small and a large model, with infeasible requests ending in one line."""
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

import models
from bench.plan import cli as plan
from bench.plan import comm_time, memory, validation
from bench.plan import hardware as rl
from bench.plan import search as plan_search
from bench.plan import step_time as pm
from tests.helpers import quiet

TINY = models.GPTConfig(**models.config.PRESETS["tiny"])
# a made-up node where times are bytes or FLOPs: 1 FLOP/s, 1 B/s everywhere, no latency, full efficiency
UNIT = rl.Cluster("unit", rl.Hardware("unit", flops=1.0, hbm=1.0, link=1.0, source="test", gpus_per_node=8,
                                     inter_node=1.0),
                  memory=1e30, reserved=0.0, gemm_efficiency=1.0, comm_efficiency=1.0,
                  attention_efficiency=1.0, op_overhead=0.0, source="test")


# ---- closed forms -------------------------------------------------------------------------------------------------


def test_bubble_closed_forms_equal_the_schedule_simulator():
    from tp.pipeline import schedules

    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            for name, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 4)):
                timeline = schedules.simulate(schedules.build(name, p, m, v), costs=(1.0, 1.0, 1.0))
                assert pm.bubble_fraction(p, m, v) == pytest.approx(timeline.bubble_fraction), (name, p, m, v)
    assert pm.bubble_fraction(4, 8) == 3 / 11 and pm.bubble_fraction(4, 8, 2) == 3 / 19
    assert pm.bubble_fraction(1, 5) == 0


def test_collective_volumes_by_hand():
    """Per layer on the unit node (seconds = bytes): tp's two column->row pairs, cp's K/V ring, pp's p2p, dp."""
    c = models.GPTConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4,
                         ffn_hidden_size=128)
    tokens, e = 2 * 32, 2  # micro-batch 2 x 32 tokens, bf16
    n = e * tokens * 64
    plain = comm_time.tp_comm(c, pm.Plan(4, 1, 1, 1, 1, 2), tokens, UNIT, e)
    assert plain == (2 * 2 * 3 / 4 * n, 2 * 2 * 3 / 4 * n)  # one all-reduce per pair and direction: 2(p-1)/p·n
    sp = comm_time.tp_comm(c, pm.Plan(4, 1, 1, 1, 1, 2, sp=True), tokens, UNIT, e)
    assert sp == (2 * 2 * 3 / 4 * n, 2 * 3 * 3 / 4 * n)  # AG + RS forward; AG, re-gather AG and RS backward
    # cp ring: 2·b·s/cp·kv·d elements of K/V per rank; kv heads 4 over tp 2 -> 2 local, head_dim 8
    ring = pm.Plan(2, 2, 1, 1, 1, 2)
    assert pm.cp_kv_elements(c, ring, 32) == 2 * 2 * 16 * 2 * 8
    fwd, bwd = comm_time.cp_comm(c, ring, 32, UNIT, e, (0.0, 0.0))  # nothing to hide behind
    assert (fwd, bwd) == (1 * e * 1024, 1 * (e + 4) * 1024)  # cp-1 steps; backward K/V again plus fp32 dK/dV
    assert comm_time.cp_comm(c, ring, 32, UNIT, e, (1e9, 1e9)) == (0.0, 0.0)  # hidden behind the attention blocks
    # pp: one activation [s/cp(/tp), b, h]
    assert pm._p2p_time(c, pm.Plan(2, 1, 2, 1, 1, 2, sp=True), 32, UNIT, pm.OURS) == e * 16 * 2 * 64
    # dp: ddp all-reduces the fp32 gradients, 2(d-1)/d of them; zero1 reduce-scatters them and gathers bf16 params
    stage_params = pm._stage_params(c, pm.Plan(1, 1, 1, 1, 4, 1), 0)
    empty = pm.StageTimes()
    ddp = pm._dp_time(c, pm.Plan(1, 1, 1, 1, 4, 1), UNIT, pm.OURS, 0, empty, 1)
    assert ddp == pytest.approx(2 * 3 / 4 * 4 * stage_params)
    zero1 = pm._dp_time(c, pm.Plan(1, 1, 1, 1, 4, 1, dp_mode="zero1"), UNIT, pm.OURS, 0, empty, 1)
    assert zero1 == pytest.approx(3 / 4 * 4 * stage_params + 3 / 4 * 2 * stage_params)


def test_model_flops_are_narayanan_et_als_count():
    """GPT-3 shapes: 72·L·h²·(1 + s/(6h) + V/(12·L·h)) per token; with full recomputation their eq. 3,
    96·L·h²·(1 + s/(6h) + V/(16·L·h))."""
    h, layers, s, v = 12288, 96, 2048, 51200
    c = models.GPTConfig(**(validation.GPT3_SHAPE | dict(hidden_size=h, num_layers=layers, num_heads=96)))
    model = pm.model_flops_per_token(c, s)
    assert model == pytest.approx(72 * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h)))
    hardware = model + pm.recompute_flops_per_token(c, s, "full")
    assert hardware == pytest.approx(96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))
    assert pm.recompute_flops_per_token(c, s, "selective") == 4 * layers * h * s


def test_step_time_adds_up():
    a100 = rl.CLUSTERS["a100-80g"]
    c = models.GPTConfig(**(validation.GPT3_SHAPE | dict(hidden_size=4096, num_layers=32, num_heads=32)))
    for p in (pm.Plan(8, 1, 4, 2, 4, 1, "selective", True, "zero1"), pm.Plan(4, 2, 1, 1, 16, 2, "full", False, "fsdp"),
              pm.Plan(1, 1, 2, 1, 64, 4, "none", False, "ddp")):
        r = pm.step_time(c, p, seq_len=2048, global_batch_size=512, cluster=a100, software=pm.OURS)
        assert sum(r["breakdown"].values()) == pytest.approx(r["step_s"])
        assert r["tokens_per_s"] == pytest.approx(512 * 2048 / r["step_s"])
        flops = pm.model_flops_per_token(c, 2048) * 512 * 2048
        assert r["mfu"] == pytest.approx(flops / (r["step_s"] * p.gpus * a100.device.flops))
        assert r["hfu"] >= r["mfu"]
    # compute-bound GEMMs: twice the efficiency, half the GEMM time
    p = pm.Plan(8, 1, 1, 1, 1, 4)
    slow = pm.step_time(c, p, seq_len=2048, global_batch_size=4, cluster=replace(a100, gemm_efficiency=0.4))
    fast = pm.step_time(c, p, seq_len=2048, global_batch_size=4, cluster=replace(a100, gemm_efficiency=0.8))
    assert fast["breakdown"]["gemm"] == pytest.approx(slow["breakdown"]["gemm"] / 2, rel=0.01)


def test_cpu_mfu_is_against_the_cores_the_ranks_share():
    """On the CPU profile 4 ranks on 2 cores have 2 cores' peak: MFU is model FLOPs / (step × 2 cores), as for 2
    ranks (the sharing slows each rank's compute once, it does not also halve the peak)."""
    cpu = replace(UNIT, name="cpu", cores=2)
    for dp in (1, 2, 4):
        r = pm.step_time(TINY, pm.Plan(1, 1, 1, 1, dp, 4 // dp), seq_len=64, global_batch_size=4, cluster=cpu,
                         software=pm.OURS_CPU)
        flops = pm.model_flops_per_token(TINY, 64) * 4 * 64
        assert r["mfu"] == pytest.approx(flops / (r["step_s"] * min(dp, 2) * UNIT.device.flops)), dp


# ---- validation ---------------------------------------------------------------------------------------------------


def test_published_runs_within_20_percent_and_fitting_in_memory():
    rows = validation.published_rows(rows=validation.PUBLISHED)
    assert len(rows) == 18 and all(r["fits"] for r in rows)  # every published configuration fits the estimate
    errors = {(r["row"], k): r[k] for r in rows for k in r if k.startswith("error_")}
    assert len(errors) == 22 and max(map(abs, errors.values())) <= 0.2, errors


def test_h100_runs_within_20_percent_each_with_its_source():
    """Every reached H100 bf16 row (dense and MoE) is within 20 % on the h100-sxm profile as committed, each names
    its source and the figure it read there; the MoE rows carry their ep and etp."""
    rows = validation.published_rows(rows=validation.H100_PUBLISHED)
    assert len(rows) == 15 and {r["hardware"] for r in rows} == {"h100-sxm"}
    errors = {(r["row"], k): r[k] for r in rows for k in r if k.startswith("error_")}
    assert len(errors) == 15 and max(map(abs, errors.values())) <= 0.2, errors
    assert sum(map(abs, errors.values())) / len(errors) <= 0.1, errors  # the bar: mean |error| <= 10 %
    for row in validation.H100_PUBLISHED:
        assert row.source and row.note and row.software.precision == "bf16"
        for value in row.published.values():  # the figure as the source prints it, or the iteration time it is from
            assert f"{value:,}" in row.source or "iteration" in row.source, row.name
    moe = [r for r in rows if r["ep"] > 1]
    assert {r["row"] for r in moe} == {"Grok-1 314B (512 H100)", "Grok-1 314B (2048 H100)",
                                        "Mixtral 8x7B (64 H100, ep 8)", "Mixtral 8x22B (128 H100, ep 8)"}
    assert all(f"ep{r['ep']} etp{r['etp']}" in r["plan"] for r in moe)


def test_h100_runs_fit_under_their_softwares_memory_model():
    """Every reached H100 run ran, so each fits its GPU under its software's memory model: Transformer Engine's saved
    activations (backend "te") and the optimizer state its recipe's config names (NeMo's distributed_fused_adam,
    in bf16 for Nemotron-4 340B; Megatron-Core's distributed optimizer)."""
    rows = validation.published_rows(rows=validation.H100_PUBLISHED)
    assert all(r["fits"] for r in rows), [(r["row"], round(r["memory_gb"], 1)) for r in rows if not r["fits"]]
    assert {row.software.backend for row in validation.H100_PUBLISHED} == {"te"}
    optimizers = {row.name: (row.software.grad_bytes, row.software.optimizer_bytes)
                  for row in validation.H100_PUBLISHED}
    assert optimizers["Nemotron-4 340B (128 H100)"] == (2, 4) and optimizers["Llama 3.1 405B (576 H100)"] == (4, 10)


def test_h100_fractions_are_the_cited_measurements_not_fitted():
    """The H100 profile's fractions are the numbers its source names (the GEMM efficiency fitted to bench.kernels'
    cuBLAS rates in the committed GPU runs, NCCL's 370 of 450 GB/s, FlashAttention-3's 614 TFLOP/s), not a fit to
    the rows above. A new GPU run that moves the GEMM fit fails here until the profile takes it."""
    from bench.plan import gemm

    h100 = rl.CLUSTERS["h100-sxm"]
    assert h100.gemm_efficiency == pytest.approx(gemm.fit_efficiency(), abs=1e-3) and "0.632" in h100.source
    assert h100.comm_efficiency == pytest.approx(370 / 450, abs=2e-3) and "370 of 450" in h100.source
    assert h100.cudnn_attention_efficiency == pytest.approx(614 / 989, abs=2e-3) and "614 TFLOP/s" in h100.source


def test_the_unreached_h100_runs_are_listed_with_their_reasons():
    """--validate lists the H100 runs it does not reach apart (outside the 20 % statistics), each with a source, its
    published figure and why; if the model reaches one, this test says to move it among the validated rows."""
    rows = {r["row"]: r for r in validation.unreached_rows()}
    assert set(rows) == {"Llama 3.1 8B FSDP (8 H100)", "Llama 3.1 8B FSDP (128 H100)", "Llama 3 405B (8,192 H100)",
                         "Llama 3 405B (16,384 H100)"}
    assert rows["Llama 3.1 8B FSDP (8 H100)"]["published_tokens_per_s"] == 8 * 5762
    assert all("500 W" in r["why"] for name, r in rows.items() if name.startswith("Llama 3.1 8B"))
    assert all("V stages" in r["why"] for name, r in rows.items() if name.startswith("Llama 3 405B"))
    assert all(r["source"] and r["why"] for r in rows.values())
    misses = [r[k] for r in rows.values() for k in r if k.startswith("error_")]
    assert max(map(abs, misses)) > 0.2  # at least one really is out of reach (the torchtitan rows: +50 %)
    # docs/planner.md quotes each one's error as --validate prints it (a new profile moves them)
    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "planner.md").read_text().split())
    quoted = [f"{100 * r[k]:+.1f} %".replace("-", "−") for r in rows.values() for k in r if k.startswith("error_")]
    assert all(q in page for q in quoted), quoted


def test_overlaps_are_software_facts():
    """NeMo's tp-comm overlap hides tp collectives behind their GEMMs, --overlap-param-gather the zero1 gather behind
    the forward, --overlap-p2p-comm the interleaved sends: each shortens its own part of the step."""
    c = models.GPTConfig(**(plan.MODELS["llama3-70b"] | {"max_seq_len": 8192}))
    p = pm.Plan(4, 2, 4, 5, 2, 1, "none", True, "zero1")
    h100 = rl.CLUSTERS["h100-sxm"]
    base = replace(pm.NEMO_2024, tp_overlap=False, param_gather_overlap=False, p2p_overlap=False)
    times = {}
    for name, sw in (("none", base), ("tp", replace(base, tp_overlap=True)),
                     ("param", replace(base, param_gather_overlap=True)), ("p2p", replace(base, p2p_overlap=True))):
        times[name] = pm.step_time(c, p, seq_len=8192, global_batch_size=128, cluster=h100, software=sw)["breakdown"]
    assert times["tp"]["tp_comm"] < times["none"]["tp_comm"]  # (the dp reduce then has less backward to hide in)
    assert sum(times["tp"].values()) < sum(times["none"].values())
    assert times["param"]["dp_comm"] < times["none"]["dp_comm"]
    assert times["param"]["tp_comm"] == times["none"]["tp_comm"]
    assert times["p2p"]["pp_p2p"] < times["none"]["pp_p2p"] and times["p2p"]["gemm"] == times["none"]["gemm"]


def test_calibrated_numbers_are_a_minimum_of_the_mean_error():
    """The committed A100 efficiencies (bench.roofline) beat their neighbours: nothing was tuned per row."""
    def mean_error(gemm, comm):
        rows = validation.published_rows(validation.clusters(gemm, comm), validation.PUBLISHED)
        errors = [abs(r[k]) for r in rows for k in r if k.startswith("error_")]
        return sum(errors) / len(errors)

    g, c = validation.A100_GEMM, validation.A100_COMM
    best = mean_error(g, c)
    for dg, dc in ((0.01, 0), (-0.01, 0), (0, 0.05), (0, -0.05)):
        assert best <= mean_error(g + dg, c + dc)


def test_cpu_runs_are_compared_with_bench_train():
    overhead = validation.cpu_op_overhead()
    assert 1e-6 < overhead < 1e-4  # eager torch dispatch: microseconds to tens of microseconds per op
    rows = validation.cpu_rows(op_overhead=overhead)
    from bench.train import SPLITS, label

    assert [r["row"] for r in rows] == [f"models.train {label(*split)}" for split in SPLITS]  # bench.train's defaults
    assert abs(rows[0]["error_tokens_per_s"]) < 1e-3  # the one run the overhead is fitted to
    # more ranks than work to share: tp on gloo (collectives per layer) is predicted slower than dp (one per step)
    by = {r["row"].split()[-1]: r["predicted_tokens_per_s"] for r in rows}
    assert by["2x1x1"] < by["1x1x1"] < by["1x1x2"]


# ---- the command line ---------------------------------------------------------------------------------------------


def _run(capsys, *argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_small_model(capsys, tmp_path):
    code, out, err = _run(capsys, "--hardware", "h100-sxm", "--gpus", "8", "--model", "tiny", "--seq-len", "64",
                          "--global-batch-size", "16", "--json", "--top", "0", "--out", str(tmp_path))
    assert code == 0 and not quiet(err)
    plans = json.loads(out)["plans"]
    assert all(a["tokens_per_s"] >= b["tokens_per_s"] * (1 - 1e-9) for a, b in zip(plans, plans[1:]))  # best first
    for key in ("tp", "cp", "pp", "vp", "dp", "mbs", "recompute", "sp", "dp_mode", "memory_per_gpu_gb", "fits",
                "step_s", "tokens_per_s", "mfu", "hfu"):
        assert key in plans[0]
    assert all(p["tp"] * p["cp"] * p["pp"] * p["dp"] == 8 and p["fits"] for p in plans)
    best = plans[0]  # its memory is bench.plan.memory's estimate of that plan
    est = memory.estimate(TINY.replace(max_seq_len=64), tp=best["tp"], cp=best["cp"], pp=best["pp"], dp=best["dp"],
                          micro_batch_size=best["mbs"], seq_len=64, sequence_parallel=best["sp"] == "on",
                          recompute=best["recompute"], dp_mode=best["dp_mode"], precision="bf16",
                          virtual_stages=best["vp"], schedule="interleaved" if best["vp"] > 1 else "1f1b",
                          micro_batches=16 // (best["dp"] * best["mbs"]))
    assert best["memory_per_gpu_gb"] == est.total / 1e9
    assert (tmp_path / "plan.png").stat().st_size > 0 and json.loads((tmp_path / "plans.json").read_text())["plans"]
    # --fix pins fields; the table names its columns and the best plan's breakdown
    code, out, _ = _run(capsys, "--gpus", "8", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "16",
                        "--fix", "tp=2,pp=2,recompute=selective,sp=on,dp_mode=zero1", "--json")
    plans = json.loads(out)["plans"]
    assert code == 0 and plans and all((p["tp"], p["pp"], p["recompute"], p["sp"], p["dp_mode"]) ==
                                       (2, 2, "selective", "on", "zero1") for p in plans)
    code, out, _ = _run(capsys, "--gpus", "2", "--hardware", "cpu-measured", "--hidden", "64", "--layers", "4",
                        "--heads", "4", "--vocab", "256", "--seq-len", "64", "--global-batch-size", "16")
    assert code == 0 and "memory/GPU GB" in out and "tokens/s" in out and "best:" in out


def test_cli_large_model(capsys, tmp_path):
    config = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "max_position_embeddings": 8192, "hidden_act": "silu", "rms_norm_eps": 1e-5}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = _run(capsys, "--hardware", "h100-sxm", "--gpus", "512", "--hf-config", str(path), "--seq-len",
                          "8192", "--global-batch-size", "512", "--fix", "tp=8,dp_mode=zero1", "--json", "--top", "3")
    assert code == 0 and not quiet(err)
    plans = json.loads(out)["plans"]
    assert len(plans) == 3 and all(p["tp"] == 8 and p["dp_mode"] == "zero1" for p in plans)
    assert all(p["memory_per_gpu_gb"] <= 77 and 0.2 < p["mfu"] < 0.76 for p in plans)  # < the GEMM efficiency


def test_equally_fast_plans_rank_the_simpler_first():
    """Plans the model times alike (to 1e-9: fsdp's exposed reduce-scatter shrinks by what recompute adds to the
    backward it hides behind; cp·mbs constant) rank without cp, then with less recompute, then without interleaving
    first, not by floating-point noise: cp=2 with selective recompute once ranked above cp=1 without it."""
    config = models.GPTConfig(**(plan.MODELS["llama3-8b"] | {"max_seq_len": 8192}))
    rows, _, _ = plan.search(config, gpus=64, seq_len=8192, global_batch_size=512, cluster=rl.CLUSTERS["h100-sxm"],
                             fixed={"tp": 4, "pp": 2})
    order = plan_search.recompute_order
    inversions = [(a, b) for a, b in zip(rows, rows[1:]) if a["tokens_per_s"] == pytest.approx(b["tokens_per_s"],
                                                                                               rel=1e-9)
                  and (a["cp"], order(a["recompute"]), a["vp"]) > (b["cp"], order(b["recompute"]), b["vp"])]
    assert not inversions, inversions[:2]


def test_a_search_in_forked_processes_gives_the_one_process_result(monkeypatch):
    """A long search runs in parts over a fork pool: the same rows in the same order (ties included), the same
    smallest infeasible plan and count as one process (parts made small here to split a short search)."""
    config = models.GPTConfig(**(plan.MODELS["llama3-8b"] | {"max_seq_len": 4096}))
    where = dict(gpus=8, seq_len=4096, global_batch_size=32, cluster=rl.CLUSTERS["a100-80g"])
    alone = plan.search(config, **where, workers=1)
    monkeypatch.setattr(plan_search, "PARALLEL_PLANS", 1)
    monkeypatch.setattr(plan_search, "PART_PLANS", 997)
    pools, real_pool = [], plan_search._pool
    monkeypatch.setattr(plan_search, "_pool", lambda workers, work: pools.append(workers) or real_pool(workers, work))
    forked = plan.search(config, **where, workers=2)
    assert pools == [2] and forked == alone and alone[1] is not None and len(alone[0]) > 997 and alone[2] > 2 * 997


def test_cli_from_another_directory_top_zero_and_a_repeated_fix(capsys, tmp_path, monkeypatch):
    """The measured profile and --validate find their JSON from any working directory; --top 0 shows every plan in
    the table as in --json; a key given twice to --fix is refused, not silently overridden."""
    monkeypatch.chdir(tmp_path)
    small = ["--gpus", "2", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "4"]
    code, out, err = _run(capsys, "--hardware", "cpu-measured", *small, "--top", "0")
    assert code == 0 and not quiet(err), err
    rows = [line for line in out.splitlines() if line.count("|") > 10][1:]  # the table's rows below its header
    code, out, _ = _run(capsys, "--hardware", "cpu-measured", *small, "--top", "0", "--json")
    assert len(rows) == len(json.loads(out)["plans"]) > 1
    code, out, err = _run(capsys, "--validate", "--json")
    assert code == 0 and json.loads(out)["cpu"], err
    code, out, err = _run(capsys, *small, "--fix", "tp=2,tp=1")
    assert code == 1 and not out and err.strip() == "error: --fix 'tp=1': tp is given twice"


def test_gpus_that_fill_no_whole_number_of_nodes_are_refused(capsys):
    """64 GPUs on 3-GPU nodes is no cluster the placement model knows (it planned them as 8-GPU nodes); fewer GPUs
    than a node are one partial node."""
    small = ["--model", "tiny", "--seq-len", "64", "--global-batch-size", "64"]
    code, out, err = _run(capsys, "--gpus", "64", *small, "--gpus-per-node", "3")
    assert code == 1 and not out and err.strip() == "error: --gpus 64 is not a whole number of h100-sxm's 3-GPU nodes"
    code, out, err = _run(capsys, "--gpus", "12", *small)
    assert code == 1 and err.strip() == ("error: --gpus 12 is not a whole number of h100-sxm's 8-GPU nodes "
                                         "(--gpus-per-node sets another node size)")
    assert _run(capsys, "--gpus", "2", *small, "--gpus-per-node", "3")[0] == 0


def test_a_sequence_longer_than_a_learned_position_table_is_refused(capsys, tmp_path):
    """A Hugging Face GPT-2 config holds n_positions learned positions: a longer --seq-len cannot run (models.train
    refuses it too), so the planner says so in one line rather than plan it."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                "n_positions": 128}))
    flags = ["--gpus", "2", "--hf-config", str(path), "--global-batch-size", "4"]
    assert _run(capsys, *flags, "--seq-len", "128")[0] == 0
    code, out, err = _run(capsys, *flags, "--seq-len", "256")
    assert code == 1 and not out and err.strip() == ("error: --seq-len 256 exceeds the model's 128 learned positions "
                                                     "(max_seq_len)")


def test_unreadable_or_partial_files_are_one_line_naming_the_flag_and_file(capsys, tmp_path):
    """--hf-config and --check-mfu files: missing, not JSON, not the expected object, or a config without the
    model's shape (transformers would fill in its own defaults, Llama-2-7B's for "llama"): one line naming both."""
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "partial.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    plan_flags = ["--gpus", "2", "--seq-len", "64", "--global-batch-size", "4", "--hf-config"]
    cases = [
        (["--check-mfu", str(tmp_path / "missing.json")], r"--check-mfu .*missing.json: No such file or directory"),
        (["--check-mfu", str(tmp_path / "bad.json")], r"--check-mfu .*bad.json: not JSON \(Expecting property name"),
        (["--check-mfu", str(tmp_path / "empty.json")], r"--check-mfu .*empty.json: not bench.mfu's JSON \(no "
                                                        r"'config'\)"),
        ([*plan_flags, str(tmp_path / "bad.json")], r"--hf-config .*bad.json: not JSON"),
        ([*plan_flags, str(tmp_path / "empty.json")], r"--hf-config .*empty.json: no model_type"),
        ([*plan_flags, str(tmp_path / "partial.json")], r"--hf-config .*partial.json: no num_hidden_layers, "
                                                        r"num_attention_heads, intermediate_size, vocab_size "
                                                        r"\(transformers' defaults would stand in for the model's\)"),
        ([*plan_flags, str(tmp_path / "gpt2.json")], r"--hf-config .*gpt2.json: no num_attention_heads \(n_head\), "
                                                     r"vocab_size"),
    ]
    for argv, message in cases:
        code, out, err = _run(capsys, *argv)
        assert code == 1 and not out and len(err.splitlines()) == 1 and re.match("error: " + message, err), err


def test_fix_pins_a_micro_batch_size_or_virtual_stages_outside_the_default_sweep(capsys):
    """The sweep tries micro-batches 1..16 by powers of two and 2, 3, 4, 6, 8 virtual stages; --fix mbs=3 or vp=5
    (Llama 3 70B's 80 layers at pp 8: 2 layers a chunk) plans that value rather than finding no split."""
    small = ["--gpus", "2", "--hidden", "64", "--layers", "10", "--heads", "4", "--seq-len", "64", "--json"]
    code, out, err = _run(capsys, *small, "--global-batch-size", "12", "--fix", "mbs=3")
    assert code == 0 and {p["mbs"] for p in json.loads(out)["plans"]} == {3}, err
    code, out, err = _run(capsys, *small, "--global-batch-size", "4", "--fix", "pp=2,vp=5")
    assert code == 0 and {(p["pp"], p["vp"]) for p in json.loads(out)["plans"]} == {(2, 5)}, err


def test_infeasible_requests_end_in_one_line(capsys):
    code, out, err = _run(capsys, "--hardware", "h100-sxm", "--gpus", "8", "--model", "llama3-405b", "--seq-len",
                          "8192", "--global-batch-size", "64")
    err = quiet(err)
    assert code == 1 and not out and len(err.strip().splitlines()) == 1
    assert err.startswith("error: no plan fits 8 GPUs of h100-sxm") and "GB over the 82.5 GB usable" in err
    code, _, err = _run(capsys, "--gpus", "8", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "16",
                        "--fix", "tp=3")
    assert code == 1 and err.strip() == "error: --fix tp=3: tp=3 does not divide the 8 GPUs"
    code, _, err = _run(capsys, "--gpus", "8", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "16",
                        "--fix", "recompute=some")
    assert code == 1 and err.strip() == ("error: --fix 'recompute=some': recompute='some': expected one of none, "
                                         "selective, full or modules joined by '+' from core_attn, mlp, moe, moe_act, "
                                         "layernorm, shared_experts")


@pytest.mark.parametrize("fix,constraint", [
    ("pp=2,vp=4", "num_layers=4 is not divisible by pp*virtual_stages = 2*4 (interleaved chunks hold equal numbers "
                  "of layers); with the embedding+loss accounted: num_layers=4 + 2 (the embedding and/or loss counted "
                  "as layers) = 6 is not divisible by pp*virtual_stages = 2*4"),
    ("pp=2,vp=3,account=none,first_layers=1,last_layers=3",
     "pipeline rank 0's 1 layers do not split into virtual_stages=3"),
    ("pp=2,first_layers=1,last_layers=2", "the first and last stages' layers must add up to num_layers=4 (pp=2"),
    ("pp=4,account=embedding+loss", "num_layers=4 + 2 (the embedding and/or loss counted as layers) = 6 is not "
                                    "divisible by pp*virtual_stages = 4*1"),
    ("pp=4,first_layers=1,account=loss", "the first/last stage's layers do not combine with the embedding or loss"),
    ("pp=1,vp=2", "vp=2 interleaves pipeline stages: it needs pp > 1"),
    ("tp=2,cp=1,pp=1,mbs=3", "mbs=3 does not divide the 4 sequences per dp rank"),
    ("ep=2", "ep=2 splits experts and the model has none"),
    ("tp=1,sp=on", "sp=on needs tp > 1"),
])
def test_an_impossible_fix_names_the_constraint_that_fails(capsys, fix, constraint):
    """A --fix no split satisfies ends in one line naming the broken constraint (the tiny model: 4 layers)."""
    code, _, err = _run(capsys, "--gpus", "8", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "16",
                        "--fix", fix)
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: --fix {fix}: "), err
    assert constraint in err, err


@pytest.mark.parametrize("fix,constraint", [
    ("pp=2,vp=2,dp=4", "vp=2: no micro-batch size makes the 3 sequences per dp rank a multiple of pp=2 micro-batches "
                       "(interleaving)"),
    ("tp=1,cp=1,pp=2,vp=2", "vp=2: no micro-batch size makes the 3 sequences per dp rank a multiple of pp=2"),
    ("pp=2,vp=2,dp=4,mbs=1", "vp=2: the 3 micro-batches are not a multiple of pp=2 (interleaving)"),
])
def test_interleaving_without_a_micro_batch_count_pp_divides_is_named(capsys, fix, constraint):
    """vp > 1 needs the micro-batches a multiple of pp: with dp pinned (or given by tp, cp and pp) and no mbs making
    them one, the line names it (it blamed the model's heads and sizes)."""
    code, _, err = _run(capsys, "--gpus", "8", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "12",
                        "--fix", fix)
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith(f"error: --fix {fix}: "), err
    assert constraint in err, err
