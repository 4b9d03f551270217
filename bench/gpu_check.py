"""One prepared GPU check: what a short lease on one H100/H200 should run, each section a subprocess under its own
timeout, recorded as it goes.

    python -m bench.gpu_check --out DIR [--only NAME ...] [--budget SECONDS]

Sections, in order of value (`--only` reruns some and keeps the others' earlier results in DIR/summary.json):
  env          versions, the device, its memory and multiprocessors
  job          `python -m models.train` for 2 steps under torchrun with one rank
  multirank    multi-rank tests with 2 and 4 ranks sharing the GPU over gloo, tensors on the GPU (TP_TEST_DEVICE=cuda)
  bench_kernels  bench.kernels on MLP shard shapes and the fused dropout + residual add, and the Triton GEMM vs
               cuBLAS on square bf16 matrices; fp8 GEMMs (both recipes) vs bf16 cuBLAS on those shapes and 4096³/8192³;
               on Hopper each persistent tile alone at 4096 (tile_sweep_4096)
  mfu          one GPU, bf16: bench.mfu's whole training step of a Llama-3.2-1B shape (hidden 2048, 16 layers, 32/8
               heads, ffn 8192, vocab 128256, seq 4096) on the torch backend, "auto", "auto" with compiled blocks and
               that in fp8 (tensorwise), at the recompute and micro-batch size a 30 s --search on "torch" found
               fastest: tokens/s, MFU, peak memory, host syncs per step, the profiler's time breakdown, the
               planner's predicted step (mfu.json)
  kernels      the kernel test files compiled on the GPU with one autotune config per family (TP_KERNELS_TUNE=one),
               then the GPU-only kernel tests with full tuning
  grouped      bench.grouped: the experts' grouped GEMMs (SwiGLU fc1, fc2; fwd, dgrad, wgrad into main_grad) on the
               torch backend, torch._grouped_mm, the Triton backend (Hopper: kernels.grouped_hopper) and the sm80
               kernels; each layer's forward + backward in fp8, tensorwise with and without the kept casts, rowwise
               (grouped.json)
  gpt_step     one GPU, bf16: a GPT (hidden 2048, 8 layers, GQA 16/4 heads, vocab 32000, seq 2048) fwd+bwd on the
               Triton and the torch backends: loss and grad-norm difference, tokens/s, MFU, peak memory
  intensity    bench.intensity measured on the device (achieved bf16 TFLOP/s per shard shape) and its plot
  suite        the rest of the suite's GPU-relevant files, tensors on the GPU

DIR gets summary.json ({"device", "torch", "triton", "sections": [{"name", "status": "pass"|"fail"|"skipped",
"seconds", "details"}]}, rewritten after every section), summary.md at the end, log.txt (every section's output),
kernels.json, grouped.json, mfu.json, intensity.json and intensity.png: at most 9 files. Without CUDA every
section runs a CPU smoke (tiny shapes, Triton's interpreter) and the GPU-only parts say "skipped":
tests/test_gpu_check.py runs it so that it keeps working between leases.
"""
import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.common import at_least

ROOT = Path(__file__).resolve().parents[1]
RESULT = "GPU_CHECK_RESULT "  # the line a section's process prints its details on
MIN_SECTION_S = 20  # --budget: a section is not started with less left
INTERRUPT_GRACE = 5  # seconds a timed-out command has, after SIGINT, to report before SIGKILL


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    timeout: float  # seconds on a GPU; the CPU smoke gets the same
    doc: str


SECTIONS = [
    Section("env", 45, "versions and device"),
    # run 4 (H200): the job failed at its first step and 7 of 31 multi-rank tests failed, each a bug no CPU test had
    # shown; both sections are short (50 s, 59 s): first, to confirm the fixes
    Section("job", 75, "the training job, 2 steps, one rank under torchrun"),
    Section("multirank", 60, "2 and 4 ranks sharing the device over gloo"),
    # issue 36's numbers (auto's measured choices, the Hopper GEMMs against cuBLAS, FP8): 163 s in run 4, autotuning
    # every Hopper and sm80 config from a cold cache, then the square GEMM and a sweep of the persistent tiles at 4096
    Section("bench_kernels", 240, "bench.kernels (auto's measured choices), Triton vs cuBLAS GEMM, its tiles"),
    Section("mfu", 180, "bench.mfu: the 1B shape's training step at its best setting, eager and compiled"),
    # run 4: every kernel test passed compiled with one config (84 s); the fully tuned GPU-only ones need ~80 s more
    Section("kernels", 190, "kernel tests compiled on the device"),
    Section("grouped", 90, "bench.grouped: the experts' grouped GEMM, Hopper TMA vs sm80 kernels vs torch"),
    Section("gpt_step", 60, "one-GPU bf16 GPT step: Triton vs torch"),
    Section("intensity", 90, "bench.intensity measured on the device"),
    Section("suite", 100, "the suite's GPU-relevant files"),
]


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ---------------------------------------------------------------- helpers run inside a section's process

def budget(seconds: float, on_gpu: bool) -> float:
    """A command's timeout: its GPU seconds, or 3x on the CPU smoke (a loaded CI machine is slow at start-up)."""
    return seconds if on_gpu else 3 * seconds


def run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run cmd in its own process group (interrupted, then killed whole on timeout) -> (returncode, output); 124 on
    timeout."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # (the user's entries kept)
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    # SIGINT's default restored in the command: started from a background shell or nohup (which ignore SIGINT, and
    # children inherit that), it would ignore the interrupt below and lose its report to the SIGKILL
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        # SIGINT first: pytest then prints the failures so far and writes its JUnit report, a benchmark its traceback
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=INTERRUPT_GRACE)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return 124, out + f"\n[timed out after {timeout:.0f} s]"
    except BaseException:  # this process interrupted (its own section's timeout): its command goes with it
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def pytest(args: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run pytest on args; counts from its JUnit XML, and the failed tests' names."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp, "junit.xml")
        rc, out = run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-m",
                       "not slow", "-rfE", f"--junitxml={xml}", *args], timeout, env)
        print(out)
        if not xml.exists():
            return {"returncode": rc, "error": "no report (crashed or timed out)", "tail": out[-1500:]}
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        failed = [f"{c.get('classname')}::{c.get('name')}: {_message(c)}" for c in suite.iter("testcase")
                  if _message(c) is not None]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"returncode": rc, **counts, "failed": failed[:40], "seconds": float(suite.get("time", 0))}


def _message(case: ET.Element) -> str | None:
    """A failed or erroring JUnit test case's message, shortened (None when it passed or was skipped)."""
    found = case.find("failure") if case.find("failure") is not None else case.find("error")
    if found is None:
        return None
    text = found.get("message") or found.text or ""
    lines = [ln for ln in text.splitlines() if "Error" in ln or "assert" in ln] or text.splitlines() or [""]
    return lines[-1].strip()[:300]


def parallel(workers: int) -> list[str]:
    """pytest-xdist's -n where it is installed (the GPU machines have it)."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return []
    return ["-n", str(workers)]


def passed(result: dict) -> bool:
    return result.get("returncode") == 0


# ---------------------------------------------------------------- sections

def section_env(out: Path, on_gpu: bool) -> dict:
    import torch
    import triton

    details = {"python": sys.version.split()[0], "torch": torch.__version__, "triton": triton.__version__,
               "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    for name in ("numpy", "transformers", "tensorboard", "pyarrow", "pytest", "einops", "safetensors", "tokenizers"):
        try:
            details[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - record what is missing, carry on
            details[name] = f"missing ({type(e).__name__})"
    import numpy

    from kernels.configs import interpreter_numpy_problem

    # (the suite's CPU tests run the kernels under the interpreter: Triton < 3.7 cannot with NumPy >= 2.4)
    details["interpreter"] = interpreter_numpy_problem(triton.__version__, numpy.__version__) or "ok"
    if on_gpu:
        p = torch.cuda.get_device_properties(0)
        details.update(device=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                       memory_gib=round(p.total_memory / 2**30, 1), devices=torch.cuda.device_count())
        rc, smi = run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv"], 20)
        details["nvidia_smi"] = smi.strip().splitlines()[-1] if rc == 0 else f"rc {rc}"
    return {**details, "ok": True}


def section_kernels(out: Path, on_gpu: bool) -> dict:
    files = ["tests/test_kernels.py", "tests/test_moe_kernels.py", "tests/test_kernels_hopper.py",
             "tests/test_fp8.py::test_the_fused_cast_writes_torchs_e4m3_bits",
             "tests/test_fp8.py::test_the_fused_cast_writes_torchs_e5m2_bits"]
    if not on_gpu:  # the suite runs these files in full on CPU; here one interpreter test keeps the path alive
        result = pytest([files[0], "-k", "test_weight_only_gradient_skips_dgrad and gelu"], budget(120, on_gpu))
        return {"interpreter": result, "gpu_only": "skipped (no CUDA)", "ok": passed(result)}
    on_device = {"TP_TEST_DEVICE": "cuda"}  # (the default run's tensors are on the CPU, under the interpreter)
    one = pytest([*files, *parallel(4), "-k", "not test_gpu_"], 100, {**on_device, "TP_KERNELS_TUNE": "one"})
    full = pytest([files[0], "-k", "test_gpu_"], 85, on_device)
    return {"one_config": one, "full_tuning": full, "ok": passed(one) and passed(full)}


def section_job(out: Path, on_gpu: bool) -> dict:
    log_dir = tempfile.mkdtemp(prefix="gpu_check_job_")
    flags = ["--tp", "1", "--pp", "1", "--dp", "1", "--steps", "2", "--global-batch-size", "2",
             "--micro-batch-size", "2", "--log-interval", "1", "--no-sample", "--log-dir", log_dir,
             *(["--device", "cuda", "--precision", "bf16", "--model", "small", "--seq-len", "512"] if on_gpu
               else ["--seq-len", "32"])]
    rc, text = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    "-m", "models.train", *flags], budget(70, on_gpu))
    print(text[-20000:])
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted(Path(log_dir).rglob("*.log")))
    return {"returncode": rc, "flags": " ".join(flags[:-2]), "tail": (text + logs)[-2500:], "ok": rc == 0}


def section_bench_kernels(out: Path, on_gpu: bool) -> dict:
    shapes = ["--hidden", "4096", "--tokens", "8192", "--tp", "1"] if on_gpu else \
        ["--quick", "--shrink", "128", "--layers", "fc1", "--tp", "2", "--reps", "1"]
    rc, text = run([sys.executable, "-m", "bench.kernels", *shapes, "--kernels", "linear", "choices", "dropout", "fp8",
                    "--out", str(out / "kernels.json")], budget(150, on_gpu))
    print(text[-20000:])
    details = {"returncode": rc, "table": text[-3000:], "ok": rc == 0}
    if on_gpu:
        from bench.gpu_sections import square_gemm, tile_sweep
        from bench.kernels import has_hopper_kernels

        details["square_gemm"] = square_gemm()
        details["tile_sweep_4096"] = tile_sweep() if has_hopper_kernels(True) else "skipped (not a Hopper GPU)"
    else:
        details["square_gemm"] = "skipped (no CUDA)"
    return details


def section_grouped(out: Path, on_gpu: bool) -> dict:
    shapes = [] if on_gpu else ["--shapes", "4x256x128", "--rows", "2048"]
    rc, text = run([sys.executable, "-m", "bench.grouped", *shapes, "--out", str(out / "grouped.json")],
                   budget(85, on_gpu))
    print(text[-20000:])
    return {"returncode": rc, "table": text[-3000:], "ok": rc == 0}


def section_intensity(out: Path, on_gpu: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_intensity_"))
    opts = ["--hidden", "4096", "--mlp", "swiglu", "--tokens", "4096", "--measure-tp", "2", "--max-message-mb", "8",
            "--min-seconds", "0.01"] if on_gpu else ["--no-measure", "--hidden", "1024", "--tokens", "1024"]
    rc, text = run([sys.executable, "-m", "bench.intensity", *opts, "--out", str(tmp)], budget(80, on_gpu))
    print(text[-20000:])
    for name in ("intensity.json", "intensity.png"):
        if (tmp / name).exists():
            shutil.copy(tmp / name, out / name)
    return {"returncode": rc, "table": text[-3000:], "measured": on_gpu or "skipped (no CUDA)", "ok": rc == 0}


# tp.testing's ranks with their tensors on the shared GPU (run 3 had a job test here: 8 ranks, which the job refuses
# on one GPU)
MULTIRANK = ["tests/test_layers.py::test_mlp_matches_dense", "tests/test_vocab.py::test_cross_entropy_matches_dense",
             "tests/test_optim.py::test_clip_grad_norm_is_the_serial_models_norm",
             "tests/test_random.py::test_fork_rng_differs_per_tp_rank_and_default_is_shared",
             "tests/test_context.py::test_attention_equals_dense_sdpa"]


def section_multirank(out: Path, on_gpu: bool) -> dict:
    if not on_gpu:
        result = pytest([MULTIRANK[3]], budget(55, on_gpu))
        return {"cpu": result, "gpu": "skipped (no CUDA)", "ok": passed(result)}
    result = pytest([*MULTIRANK, "--timeout", "45"], 55, {"TP_TEST_DEVICE": "cuda"})
    return {"tests": result, "ok": passed(result)}


SUITE = ["tests/test_mappings.py", "tests/test_gpt.py", "tests/test_generate.py", "tests/test_moe.py",
         "tests/test_moe_gpt.py", "tests/test_pipeline.py", "tests/test_cp_model.py", "tests/test_clip.py",
         "tests/test_checkpoint.py", "tests/test_train.py"]


def section_suite(out: Path, on_gpu: bool) -> dict:
    if not on_gpu:
        return {"skipped": "the suite runs in CI on CPU", "ok": True}
    result = pytest([*SUITE, *parallel(8), "--timeout", "90", "--maxfail", "40"], 95, {"TP_TEST_DEVICE": "cuda"})
    return {"tests": result, "ok": passed(result)}


def section_mfu(out: Path, on_gpu: bool) -> dict:
    from bench.mfu import gpu_check_section

    return gpu_check_section(on_gpu, out)


def section_gpt_step(out: Path, on_gpu: bool) -> dict:
    from bench.gpu_sections import gpt_step

    return gpt_step(on_gpu)


RUNNERS = {s.name: globals()[f"section_{s.name}"] for s in SECTIONS}


# ---------------------------------------------------------------- the driver

def run_section(section: Section, out: Path, smoke: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.gpu_check", "--section", section.name, "--out", str(out)]
    start = time.perf_counter()
    env = {"PYTHONUNBUFFERED": "1", **({"TRITON_INTERPRET": "1"} if smoke else {})}  # interpreter without CUDA
    rc, text = run(cmd, budget(section.timeout, not smoke), env)
    seconds = round(time.perf_counter() - start, 1)
    with open(out / "log.txt", "a") as log:
        log.write(f"\n===== {section.name} (rc {rc}, {seconds} s)\n{text}")
    lines = [ln for ln in text.splitlines() if ln.startswith(RESULT)]
    details = json.loads(lines[-1][len(RESULT):]) if lines else {}
    if rc != 0 or not lines:  # (one interrupted at its timeout may still print its result in the grace period)
        details["tail"] = text[-2500:]
    ok = rc == 0 and details.pop("ok", False)
    status = "fail" if not ok else "skipped" if "skipped" in details else "pass"  # (a section that ran nothing)
    return {"name": section.name, "status": status, "seconds": seconds, "details": details}


def header() -> dict:
    import torch
    import triton

    device = torch.cuda.get_device_name(0) if cuda() else f"CPU ({os.cpu_count()} cores, no CUDA: smoke run)"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__, "sections": []}


def write_markdown(summary: dict, out: Path) -> None:
    rows = [f"| {s['name']} | {s['status']} | {s['seconds']} | {_gist(s['details'])} |" for s in summary["sections"]]
    text = (f"# GPU check on {summary['device']}\n\ntorch {summary['torch']}, Triton {summary['triton']}\n\n"
            "| section | status | seconds | details |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    (out / "summary.md").write_text(text)


def _gist(details: dict) -> str:
    """A short one-line reading of a section's details for the Markdown table."""
    keep = {k: v for k, v in details.items() if k not in ("tail", "table") and not isinstance(v, (dict, list))}
    for k, v in details.items():
        if isinstance(v, dict) and "tests" in v:
            keep[k] = f"{v['tests'] - v['failures'] - v['errors'] - v['skipped']}/{v['tests']} passed"
    return ", ".join(f"{k}={v}" for k, v in keep.items()).replace("|", "/")[:400]


def main(argv: list[str] | None = None) -> int:
    names = [s.name for s in SECTIONS]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for summary.json, summary.md and the section files")
    p.add_argument("--only", nargs="+", choices=names, help="run these sections; keep the others' earlier results")
    p.add_argument("--budget", type=at_least(MIN_SECTION_S),
                   help="seconds for the whole check: a section gets at most what is left, and none starts with under "
                   f"{MIN_SECTION_S} s left (skipped); summary.md is written either way")
    p.add_argument("--section", choices=names, help=argparse.SUPPRESS)  # (one section, in its own process)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        details = RUNNERS[args.section](out, cuda())
        print(RESULT + json.dumps(details, default=str), flush=True)
        return 0
    summary = header()
    previous = out / "summary.json"
    if args.only and previous.exists():
        summary["sections"] = json.loads(previous.read_text())["sections"]
    deadline = math.inf if args.budget is None else time.monotonic() + args.budget
    for section in (s for s in SECTIONS if not args.only or s.name in args.only):
        left = deadline - time.monotonic()
        if left < MIN_SECTION_S:
            result = {"name": section.name, "status": "skipped", "seconds": 0.0,
                      "details": {"skipped": f"{left:.0f} s of --budget left"}}
        else:
            result = run_section(dataclasses.replace(section, timeout=min(section.timeout, left)), out,
                                 smoke=not cuda())
        summary["sections"] = [s for s in summary["sections"] if s["name"] != section.name] + [result]
        summary["sections"].sort(key=lambda s: names.index(s["name"]))
        previous.write_text(json.dumps(summary, indent=1))
        print(f"{section.name:14s} {result['status']:7s} {result['seconds']:7.1f} s  {_gist(result['details'])[:150]}",
              flush=True)
    write_markdown(summary, out)
    return int(any(s["status"] == "fail" for s in summary["sections"]))


if __name__ == "__main__":
    sys.exit(main())
