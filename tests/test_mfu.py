"""bench.mfu's --search (recompute × micro-batch size, the planner's fastest first, out-of-memory and over-time
candidates passed over, the rows at the fastest) and the planner's one-device prediction beside each measured row
(bench.plan.measured, `python -m bench.plan --check-mfu`)."""
import json
from dataclasses import replace

import pytest
import torch

from bench import mfu, mfu_profile
from bench import plan as bench_plan
from bench.plan import hardware, measured
from bench.plan.software import OURS_CPU
from bench.plan.step_time import Plan, step_time
from bench.plan.validation import cpu_op_overhead
from models import GPTConfig

TINY = ["--model", "tiny", "--layers", "1", "--seq-len", "8", "--steps", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A real CPU run: every candidate of recompute × batches 1, 2 measured, then the torch row at the best (torch:
    "auto" is Triton's interpreter under the suite, ~20x slower, and test_gpu_check's smoke runs it)."""
    path = tmp_path_factory.mktemp("mfu") / "mfu.json"
    mfu.main([*TINY, "--rows", "torch", "--search-row", "torch", "--no-profile", "--search", "--search-batches",
              "1", "2", "--search-seconds", "1e9", "--out", str(path)])
    return json.loads(path.read_text()), path


def test_the_search_tries_every_candidate_fastest_predicted_first_and_the_rows_run_at_the_best(searched):
    payload, _ = searched
    tried = payload["search"]["candidates"]
    assert sorted((c["recompute"], c["batch"]) for c in tried) == sorted(
        (r, b) for r in mfu.RECOMPUTE for b in (1, 2))
    assert all(c["status"] == "measured" and c["tokens_per_s"] > 0 for c in tried)
    order = [(not c["predicted_fits"], -c["predicted_tokens_per_s"]) for c in tried]
    assert order == sorted(order)
    best = max(tried, key=lambda c: c["tokens_per_s"])
    assert payload["search"]["best"] == best
    (row,) = payload["rows"]
    assert (row["row"], row["recompute"], row["batch"]) == ("torch", best["recompute"], best["batch"])


def test_each_row_carries_the_planners_prediction_for_its_one_device_plan(searched):
    """The prediction is the planner's step_time of the measured shape, micro-batch and recompute at tp = cp = pp =
    dp = 1 on cpu-measured (its compute times the run's threads), not a constant: it grows with the batch."""
    payload, _ = searched
    config = GPTConfig(**payload["config"])
    cpu = hardware.cpu_cluster(op_overhead=cpu_op_overhead())
    cpu = replace(cpu, device=replace(cpu.device, flops=cpu.device.flops * min(payload["threads"], cpu.cores)))

    def planner_step(recompute, batch):
        return step_time(config, Plan(1, 1, 1, 1, 1, batch, recompute), seq_len=payload["seq_len"],
                         global_batch_size=batch * payload["micro_batches"], cluster=cpu, software=OURS_CPU)["step_s"]

    (row,) = payload["rows"]
    predicted = row["predicted"]
    assert predicted["profile"] == "cpu-measured"
    assert predicted["step_s"] == pytest.approx(planner_step(row["recompute"], row["batch"]), rel=1e-12)
    assert predicted["ratio"] == pytest.approx(predicted["step_s"] / row["step_s"], rel=1e-2)
    for c in payload["search"]["candidates"]:
        assert c["predicted_step_s"] == pytest.approx(planner_step(c["recompute"], c["batch"]), rel=1e-12)
    assert planner_step("none", 2) > planner_step("none", 1) and planner_step("full", 1) > planner_step("none", 1)


def test_check_mfu_prints_predicted_vs_measured_per_row(searched, capsys, tmp_path):
    payload, path = searched
    assert bench_plan.main(["--check-mfu", str(path)]) == 0
    out = capsys.readouterr().out
    assert "predicted/measured" in out and out.count("cpu-measured") == 1 + len(payload["search"]["candidates"])
    unknown = tmp_path / "tpu.json"
    unknown.write_text(json.dumps(payload | {"machine": "TPU v5e"}))
    assert bench_plan.main(["--check-mfu", str(unknown)]) == 1
    assert "device 'TPU v5e': no planner profile" in capsys.readouterr().err


@pytest.fixture
def tiny_base():
    with mfu.one_rank():
        yield mfu.base_model(GPTConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                       max_seq_len=8), torch.float32)


def test_a_candidate_out_of_memory_or_past_the_time_is_passed_over(monkeypatch, tiny_base):
    def fake_row(row, base, *, batch, **_):
        if batch == 4:
            torch.empty(1).add_(1)  # (a tensor the failed candidate held)
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"row": row, "recompute": base.config.recompute, "batch": batch, "step_s": 1 / batch,
                "tokens_per_s": 8.0 * batch, "breakdown": None}

    monkeypatch.setattr(mfu, "measure_row", fake_row)
    candidates = mfu.search_order(tiny_base.config, batches=(1, 4, 2), micro_batches=1, seq_len=8,
                                  device_name="an unknown accelerator", dtype="fp32", threads=1)
    assert [(c["recompute"], c["batch"]) for c in candidates[:3]] == [("none", 4), ("none", 2), ("none", 1)]
    common = dict(device=torch.device("cpu"), micro_batches=1, seq_len=8, steps=1, warmup=0, clip=1.0, peak=None)
    tried = mfu.search(tiny_base, "auto", candidates, seconds=1e9, **common)
    assert [c["status"] for c in tried if c["batch"] == 4] == ["out of memory"] * 3
    assert mfu.best_of(tried)["batch"] == 2 and "ratio" not in tried[1]  # (no profile: no prediction)
    first_only = mfu.search(tiny_base, "auto", candidates[1:], seconds=0, **common)
    assert [c["status"] for c in first_only] == ["measured"] + ["skipped (time)"] * 7
    with pytest.raises(ValueError, match="no candidate ran"):
        mfu.best_of(tried[:1])


def test_the_gpu_profiles_are_found_by_the_device_name():
    h200, software = measured.profile_for("NVIDIA H200 (torch 2.11.0+cu130)")
    h100, _ = measured.profile_for("NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130)")
    assert (h200.name, h100.name, software.precision) == ("h200", "h100-sxm", "bf16")
    assert h200.device.flops == h100.device.flops and h200.device.hbm > h100.device.hbm
    assert h200.memory > 1.7 * h100.memory  # (141 GB of HBM3e, 80 GB of HBM3)
    # the GPU check's 1B shape (bench.mfu.LLAMA_1B) at seq 4096: the H200 is no slower than the H100
    config = mfu.config_of(mfu.build_parser().parse_args(
        ["--model", "llama3-8b", *(f"--{k.replace('_', '-')}={v}" for k, v in mfu.LLAMA_1B.items()),
         "--seq-len", "4096"]))
    steps = [measured.predict_step(config, batch=2, micro_batches=1, seq_len=4096, recompute="none", cluster=c,
                                   software=software)["step_s"] for c in (h200, h100)]
    assert 0 < steps[0] <= steps[1]


def test_a_fp8_row_runs_the_linears_in_float8_and_bad_rows_are_one_line(tmp_path, monkeypatch, capsys):
    recipes = []
    train_step = mfu.train_step

    def recorded(model, *args):
        recipes.append(model.config.fp8_recipe)
        return train_step(model, *args)

    monkeypatch.setattr(mfu, "train_step", recorded)
    rows = mfu.main([*TINY, "--rows", "torch", "torch+fp8", "--no-profile", "--out", str(tmp_path / "m.json")])
    assert [r["row"] for r in rows] == ["torch", "torch+fp8"] and all(r["tokens_per_s"] > 0 for r in rows)
    assert set(recipes[:len(recipes) // 2]) == {None} and set(recipes[len(recipes) // 2:]) == {mfu.FP8_ROW_RECIPE}
    for bad in ("auto+fp9", "auto+compile+compile", "cuda"):
        with pytest.raises(SystemExit):
            mfu.main([*TINY, "--rows", bad])
        assert f"'{bad}': a row is one of" in capsys.readouterr().err


def test_a_failing_row_is_recorded_and_the_rows_after_it_still_run(monkeypatch, tmp_path):
    """A row that raises (a compile error, out of memory) becomes that row's error; the JSON is written after every
    row, so a run cut short keeps what it measured."""
    real = mfu.measure_row
    written = []

    def measure(row, *args, **kwargs):
        if row == "torch+compile":
            raise RuntimeError("Dynamo cannot trace this\nsecond line")
        return real(row, *args, **kwargs)

    def write(path, payload):
        written.append([r["row"] for r in payload["rows"]])

    monkeypatch.setattr(mfu, "measure_row", measure)
    monkeypatch.setattr(mfu, "write_json", write)
    rows = mfu.main([*TINY, "--rows", "torch+compile", "torch", "--no-profile", "--out", str(tmp_path / "m.json")])
    assert rows[0] == {"row": "torch+compile", "error": "RuntimeError: Dynamo cannot trace this"}
    assert rows[1]["row"] == "torch" and rows[1]["tokens_per_s"] > 0
    assert written[:2] == [["torch+compile"], ["torch+compile", "torch"]]


def test_the_cuda_breakdown_counts_each_kernel_once_and_fp8_gemms_as_gemms():
    """On CUDA torch.profiler links a record_function region (the optimizer's step) to its own span on the device,
    as if the region had launched a kernel as long as all of its ops': counted, the optimizer took 0.50 s of a
    0.76 s step (H200 run 4, its categories summing to 1.6x the step). The events here have the profiler's shape."""
    from types import SimpleNamespace as Event

    cpu = torch.autograd.DeviceType.CPU

    def op(name, kernels_us, parent=None, annotation=False):
        kernels = [Event(name=name if annotation else f"kernel of {name}", duration=us) for us in kernels_us]
        return Event(name=name, device_type=cpu, is_user_annotation=annotation, kernels=kernels, cpu_parent=parent,
                     self_cpu_time_total=1.0)

    step = op("Optimizer.step#AdamW.step", [10_000], annotation=True)
    events = [step, op("aten::_fused_adamw_", [9_000], step), op("aten::_scaled_mm", [4_000]),
              op("aten::mm", [3_000]), op("aten::add_", [500])]
    seconds = mfu_profile.op_seconds(events, cuda=True)
    assert seconds == pytest.approx({"gemm": 0.007, "attention": 0, "norm": 0, "elementwise": 0.0005, "loss": 0,
                                     "optimizer": 0.009, "idle": 0})
