"""Smoke tests of bench.gpt, bench.parallelize and bench.train at tiny sizes: they run end to end and write what they
promise. The numbers are not checked (benchmarks are not timed tests), only what holds on any machine."""
import json
import re

import pytest

pytest.importorskip("transformers")

from bench import gpt, parallelize, train  # noqa: E402


def test_gpt_benchmark_runs_and_sp_halves_the_norm_region(tmp_path):
    out = tmp_path / "gpt.json"
    gpt.main(["--tp", "2", "--iters", "1", "--warmup", "0", "--hidden", "32", "--ffn", "64", "--heads", "4",
              "--kv-heads", "2", "--vocab", "128", "--seq", "16", "--no-megatron", "--out", str(out)])
    result = json.loads(out.read_text())
    off, on = result["rows"]
    assert (off["tp"], off["sp"], on["sp"]) == (2, "off", "on")
    assert off["loss_err"] < 1e-4 and on["loss_err"] < 1e-4  # the same Llama three ways (the bench also raises)
    for row in (off, on):
        assert row["ours_ms"] > 0 and row["dtensor_ms"] > 0 and "megatron_ms" not in row
    for name in ("ours", "dtensor"):  # SP keeps 1/tp of the sequence in the norms
        assert on[f"{name}_norm_mib"] == pytest.approx(off[f"{name}_norm_mib"] / 2)
        assert 0 < on[f"{name}_mib"] < off[f"{name}_mib"]


def test_train_benchmark_runs_every_part(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "bubble.png"
    train.main(["--splits", "1x2x1", "1x1x1", "--steps", "2", "--global-batch-size", "4", "--seq-len", "16",
                "--pp", "2", "--micro-batches", "1", "2", "--reps", "1", "--bubble-hidden", "32",
                "--bubble-micro-batch", "1", "--bubble-seq", "16", "--out", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())
    piped, single = result["throughput"]
    assert (single["split"], piped["split"]) == ("1x1x1", "1x2x1")
    assert single["speedup"] == 1.0 and piped["speedup"] == piped["tokens_per_s"] / single["tokens_per_s"]
    assert "vs 1x1x1" in result["throughput_table"]
    assert single["tokens_per_s"] > 0 and piped["tokens_per_s"] > 0
    assert piped["loss"] == pytest.approx(single["loss"], abs=1e-5)  # the same training, split differently
    assert [(r["p"], r["m"], r["theory"]) for r in result["bubble"]] == [(2, 1, 0.5), (2, 2, 1 / 3)]
    for row in result["bubble"]:
        assert all(0 <= row[k] < 1 for k in ("gpipe", "1f1b", "gpipe_stages", "1f1b_stages"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parallelize_benchmark_runs_every_model(tmp_path):
    out = tmp_path / "parallelize.json"
    parallelize.main(["--tp", "2", "--iters", "1", "--warmup", "0", "--shapes", "32:64:4:2:1:1:16", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]  # (the six models' losses agree, or the bench raises)
    assert (row["hidden"], row["heads"], row["tokens"], row["tp"]) == (32, "4/2", "1x16", 2)
    for name in ("ours", "dtensor", "hf", "dense", "ours_vp", "dtensor_vp"):
        assert row[f"{name}_ms"] > 0


def test_kernels_benchmark_creates_its_output_folder(tmp_path, capsys):
    from bench import kernels as bench_kernels

    out = tmp_path / "new" / "kernels.json"
    bench_kernels.main(["--hidden", "512", "--tokens", "256", "--tp", "2", "--layers", "fc2", "--reps", "1",
                        "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"]
    printed = capsys.readouterr().out
    assert printed.count(f"wrote {out}") == 1
    # a CPU's TF/s (well under 1) shows its digits, as the JSON holds them (it printed 0.0)
    tflops = saved["fp8"][0]["fp8_tflops"]
    assert tflops < 1 and f"{tflops:.4g}" in printed
    # the "torch, Triton and auto times" per row: auto as a user runs it, against the fastest candidate
    assert all(r["auto_ms"] > 0 and r["auto_vs_fastest"] == min(r["torch_ms"], r["kernels_ms"]) / r["auto_ms"]
               for r in saved["results"])
    assert all(r["fused_bwd_dx_ms"] > 0 and r["fused_bwd_dx_dbias_ms"] > 0 for r in saved["dropout"])
    fp8 = {(r["layer"], r["phase"], r["recipe"]) for r in saved["fp8"]
           if r["fp8_ms"] > 0 and r["base_ms"] > 0 and r["gemm_only_ms"] > 0}
    assert fp8 == {(layer, phase, recipe) for recipe in ("tensorwise", "rowwise") for layer, phase in (
        ("fc2", "fwd"), ("fc2", "dgrad"), ("fc2", "wgrad_main_grad"), ("square", "fwd"))}


def test_grouped_benchmark_times_each_expert_gemm_on_uneven_groups(tmp_path, capsys):
    import torch

    from bench import grouped as bench_grouped

    counts = bench_grouped.routed_counts(512, 8)
    assert sum(counts) == 512 and len(counts) == 8 and max(counts) > min(counts)  # a router's uneven spread
    out = tmp_path / "grouped.json"
    rows = bench_grouped.main(["--shapes", "4x256x128", "--rows", "1024", "--reps", "1", "--out", str(out)])
    assert [(r["layer"], r["phase"]) for r in rows] == [(layer, phase) for layer in ("fc1", "fc2")
                                                        for phase in bench_grouped.PHASES]
    assert all(r["torch_ms"] > 0 and r["experts"] == 4 and r["hidden"] == 8 for r in rows)  # shrunk 32x on CPU
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(rows))
    # the GPU's columns, through the same code on CPU tensors (the Triton kernels interpreted; auto takes torch here)
    gpu_rows = bench_grouped.bench_layer("fc1", 4, 16, 8, 64, torch.float32, "cpu",
                                         bench_grouped.make_timer(False, 1), triton_rows=True, sm80_row=False)
    assert all(r["triton_ms"] > 0 and r["auto_ms"] > 0 and r["auto_vs_faster"] > 0 for r in gpu_rows)
    # the fp8 table: a layer's forward + backward per variant (None where torch._scaled_mm cannot take the dims)
    fp8 = bench_grouped.bench_fp8("fc2", 4, 16, 32, 64, torch.float32, "cpu", bench_grouped.make_timer(False, 1))
    assert all(fp8[f"{variant}_ms"] > 0 for variant in bench_grouped.FP8_VARIANTS) and fp8["kept_casts_speedup"] > 0
    assert bench_grouped.bench_fp8("fc2", 4, 8, 16, 64, torch.float32, "cpu", bench_grouped.make_timer(False, 1)) \
        is None
    assert json.loads(out.read_text())["fp8"] == []  # (the shrunk 8-wide layers: no fp8 rows)
    with pytest.raises(SystemExit):
        bench_grouped.main(["--shapes", "4x256"])
    assert "'4x256' is not EXHxF" in capsys.readouterr().err


@pytest.mark.parametrize("module,flags,message", [
    ("mlp", ["--iters", "0"], r"argument --iters: 0 is not >= 1"),
    ("mlp", ["--tp", "0"], r"argument --tp: 0 is not >= 1"),
    ("gpt", ["--tp", "3"], r"num_heads=8 is not divisible by tp=3"),
    ("gpt", ["--tp", "4", "--kv-heads", "2", "--no-megatron"], r"DTensor TP .* --kv-heads 2 .* --tp 4"),
    ("parallelize", ["--shapes", "128:344"], r"hidden:ffn:heads:kv_heads:layers:batch:seq, got '128:344'"),
    ("train", ["--splits", "3x1x1"], r"num_heads=4 is not divisible by tp=3"),
    ("train", ["--reps", "0"], r"argument --reps: 0 is not >= 1"),
    ("train", ["--out", "/dev/null/x.json"], r"--out /dev/null/x.json: /dev/null is not a directory"),
    ("train", ["--plot", "/dev/null/x.png"], r"--plot /dev/null/x.png: /dev/null is not a directory"),
    ("attention", ["--out", "/dev/null/x.json"], r"--out /dev/null/x.json: /dev/null is not a directory"),
    ("grouped", ["--shrink", "0"], r"argument --shrink: 0 is not >= 1"),
    ("grouped", ["--rows", "0"], r"argument --rows: 0 is not >= 1"),
    ("grouped", ["--out", "/dev/null/x.json"], r"--out /dev/null/x.json: /dev/null is not a directory"),
    ("plan", ["--gpus", "2", "--model", "tiny", "--seq-len", "64", "--global-batch-size", "4", "--out", "/dev/null/x"],
     r"--out /dev/null/x: /dev/null is not a directory"),
])
def test_impossible_arguments_are_one_usage_error_before_any_rank(module, flags, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"bench.{module}").main(flags)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
