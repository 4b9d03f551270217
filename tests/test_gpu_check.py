"""bench.gpu_check without CUDA: every section's CPU smoke runs, the GPU-only parts say skipped, the files stay within
what a device run brings back, `--only` keeps earlier results, and a section that hangs is recorded and passed over."""
import json
import subprocess
import sys

import numpy
import pytest

from bench import gpu_check
from bench import mfu as bench_mfu

pytestmark = pytest.mark.skipif(gpu_check.cuda(), reason="the CPU smoke; on a GPU run the check itself")


# The job and multirank sections' CPU smokes (a one-rank torchrun job, a two-rank pytest: 50 of the smoke's 90 s)
# run what the suite runs elsewhere; the slow test runs them too.
SLOW_SECTIONS = ("job", "multirank")


def _smoke(out, sections):
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out), "--only", *sections],
                          cwd=gpu_check.ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    return out, _smoke(out, [s.name for s in gpu_check.SECTIONS if s.name not in SLOW_SECTIONS])


@pytest.mark.slow
def test_the_job_and_multirank_sections_run_their_cpu_smoke(tmp_path):
    proc = _smoke(tmp_path, SLOW_SECTIONS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = json.loads((tmp_path / "summary.json").read_text())["sections"]
    assert [(s["name"], s["status"]) for s in sections] == [(name, "pass") for name in SLOW_SECTIONS]


def test_every_section_runs_its_cpu_smoke(smoke):
    out, proc = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"device", "torch", "triton", "sections"} and "no CUDA" in summary["device"]
    sections = {s["name"]: s for s in summary["sections"]}
    assert list(sections) == [s.name for s in gpu_check.SECTIONS if s.name not in SLOW_SECTIONS]
    assert {s["status"] for s in summary["sections"]} <= {"pass", "skipped"}
    assert sections["suite"]["status"] == "skipped"
    env = sections["env"]["details"]
    assert env["numpy"] == numpy.__version__ and env["interpreter"] == "ok"  # (else the kernels section fails too)
    assert sections["gpt_step"]["details"]["grad_norm_rel_diff"] < 1e-4  # Triton (interpreter) vs torch backends
    mfu = sections["mfu"]["details"]  # bench.mfu's rows: a rate, and the profiled step's breakdown
    assert mfu["torch"]["tokens_per_s"] > 0 and mfu["auto"]["tokens_per_s"] > 0 and mfu["compiled"].startswith("skip")
    assert set(mfu["torch"]["breakdown"]) == set(bench_mfu.BREAKDOWN) and mfu["torch"]["breakdown"]["gemm"] > 0
    # the rows at the setting --search found fastest, each beside the planner's prediction (cpu-measured here)
    assert mfu["search"]["best"] == f"recompute {mfu['auto']['recompute']} batch {mfu['auto']['batch']}"
    assert mfu["search"]["tried"][0].split(":")[1].strip().startswith("measured")
    assert mfu["auto"]["predicted"]["profile"] == "cpu-measured" and mfu["auto"]["predicted"]["ratio"] > 0
    assert mfu["torch"]["host_syncs"] == mfu["auto"]["host_syncs"] == 0  # (counted off CUDA too: tp.host_syncs)
    assert sections["kernels"]["details"]["gpu_only"].startswith("skipped")
    assert sections["bench_kernels"]["details"]["square_gemm"].startswith("skipped")
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"summary.json", "summary.md", "log.txt"} <= set(files), files
    assert "| gpt_step | pass |" in (out / "summary.md").read_text()


def test_only_reruns_a_section_and_keeps_the_others(smoke, tmp_path):
    out, _ = smoke
    earlier = json.loads((out / "summary.json").read_text())
    rerun = tmp_path / "rerun"
    rerun.mkdir()
    (rerun / "summary.json").write_text(json.dumps(earlier))
    assert gpu_check.main(["--out", str(rerun), "--only", "env"]) == 0
    again = json.loads((rerun / "summary.json").read_text())
    assert [s["name"] for s in again["sections"]] == [s["name"] for s in earlier["sections"]]
    others = [[s for s in summary["sections"] if s["name"] != "env"] for summary in (again, earlier)]
    assert others[0] == others[1]


def test_a_section_past_its_timeout_fails_with_its_last_lines(tmp_path):
    result = gpu_check.run_section(gpu_check.Section("env", 0.2, "too short"), tmp_path, smoke=True)
    assert result["status"] == "fail" and "timed out after" in result["details"]["tail"]
    assert "===== env (rc 124" in (tmp_path / "log.txt").read_text()


def test_a_command_past_its_timeout_is_interrupted_first_so_it_can_report(tmp_path):
    """On timeout the command gets SIGINT before SIGKILL: pytest then prints its failures so far and writes its JUnit
    report (run 3 on an H200 lost which multirank tests failed: killed outright, it had printed only dots)."""
    script = ("import time\ntry:\n    print('started', flush=True)\n    time.sleep(60)\n"
              "except KeyboardInterrupt:\n    print('reported what it had')\n")
    rc, out = gpu_check.run([sys.executable, "-c", script], 3)
    assert rc == 124 and "started" in out and "reported what it had" in out


def test_the_cpu_smokes_inner_commands_get_the_cpu_budget(monkeypatch, tmp_path):
    """Each CPU smoke's inner command gets 3x its GPU timeout, as its section does: a loaded 2-core machine once took
    60 s for the multirank smoke's pytest, which had the GPU's 55 s."""
    seen = []
    monkeypatch.setattr(gpu_check, "run", lambda cmd, timeout, env=None: seen.append(timeout) or (0, ""))
    gpu_check.section_multirank(tmp_path, on_gpu=False)
    gpu_check.section_job(tmp_path, on_gpu=False)
    assert seen == [3 * 55, 3 * 70]


def test_budget_gives_each_section_what_is_left_and_skips_the_rest(monkeypatch, tmp_path):
    """--budget: a section runs under min(its timeout, what is left), none starts with under MIN_SECTION_S left, and
    summary.md is written; here each section takes its whole timeout on a fake clock."""
    clock = [0.0]
    ran = []

    def run_section(section, out, smoke):
        ran.append((section.name, section.timeout))
        clock[0] += section.timeout
        return {"name": section.name, "status": "pass", "seconds": section.timeout, "details": {}}

    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(gpu_check, "run_section", run_section)
    first, second, third = gpu_check.SECTIONS[:3]
    left_for_third = third.timeout // 2  # (>= MIN_SECTION_S)
    gpu_check.main(["--out", str(tmp_path), "--budget", str(first.timeout + second.timeout + left_for_third)])
    assert ran == [(first.name, first.timeout), (second.name, second.timeout), (third.name, left_for_third)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["status"] for s in summary["sections"]] == ["pass"] * 3 + ["skipped"] * (len(gpu_check.SECTIONS) - 3)
    assert (tmp_path / "summary.md").exists()


@pytest.mark.parametrize("bad", ["0", "-5", "10"])
def test_a_budget_too_small_for_any_section_is_refused_naming_it(bad, tmp_path, capsys):
    """--budget 0 once meant no budget at all and a negative one skipped every section silently."""
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--budget", bad])
    assert f"argument --budget: {bad} is not >= {gpu_check.MIN_SECTION_S}" in capsys.readouterr().err


def test_a_section_that_reports_during_its_grace_still_fails_with_its_last_lines(monkeypatch, tmp_path):
    """A section interrupted at its timeout may still finish and print its result line in the grace period (seen
    under load): it stays a failure and keeps the output's tail."""
    printed = gpu_check.RESULT + json.dumps({"ok": True}) + "\n[timed out after 1 s]"
    monkeypatch.setattr(gpu_check, "run", lambda cmd, timeout, env=None: (124, printed))
    result = gpu_check.run_section(gpu_check.Section("env", 1, "too short"), tmp_path, smoke=True)
    assert result["status"] == "fail" and "timed out after" in result["details"]["tail"]


def test_side_by_side_timings_alternate_and_take_the_ratio_round_by_round():
    """cuBLAS's 4096³ GEMM measured 779 and 692 TFLOP/s a minute apart on one H200 (run 4): the square GEMM and the
    tile sweep time cuBLAS and the kernel in alternating rounds and take each round's ratio, not the medians'."""
    from bench import gpu_sections

    order, base, ours = [], iter([1.0, 2.0, 9.0]), iter([1.0, 4.0, 3.0])
    times = gpu_sections.interleaved({"base": lambda: order.append("base") or next(base),
                                      "ours": lambda: order.append("ours") or next(ours)}, rounds=3)
    assert order == ["base", "ours"] * 3 and times == {"base": [1.0, 2.0, 9.0], "ours": [1.0, 4.0, 3.0]}
    assert gpu_sections.ratio(times["base"], times["ours"]) == 1.0  # rounds 1, 0.5, 3 (the medians' ratio: 2/3)
