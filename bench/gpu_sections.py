"""The measuring sections of bench.gpu_check that run in-process: the one-GPU GPT step, the square GEMM and its
sweep over the persistent kernel's tiles."""
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, NVIDIA's datasheets (SXM)


def peak_flops() -> float | None:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _grad_norm(model) -> float:
    return math.sqrt(sum(p.grad.float().pow(2).sum().item() for p in model.parameters() if p.grad is not None))


def _steps(model, tokens, targets, steps: int) -> tuple[float, float, float]:
    """(first loss, its grad norm, seconds per step over `steps` timed steps after one warm-up)."""
    times = []
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        _sync()
        start = time.perf_counter()
        loss = model(tokens, targets)
        loss.backward()
        _sync()
        times.append(time.perf_counter() - start)
        if i == 0:
            first, norm = loss.item(), _grad_norm(model)
    return first, norm, sorted(times[1:])[len(times[1:]) // 2]


def gpt_step(on_gpu: bool) -> dict:
    """A GPT fwd+bwd on the Triton and the torch backends with the same weights and tokens: agreement and speed."""
    import kernels
    import tp
    from models import GPT, GPTConfig
    from models.flops import flops_per_token

    if on_gpu:
        config = GPTConfig(vocab_size=32000, hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=4,
                           max_seq_len=2048)
        batch, seq, dtype, steps, device = 2, 2048, torch.bfloat16, 5, "cuda"
    else:
        # (the CPU smoke: every Triton kernel of the step runs interpreted, so one layer and 16 tokens)
        config = GPTConfig(vocab_size=256, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, max_seq_len=16)
        batch, seq, dtype, steps, device = 2, 16, torch.float32, 1, "cpu"
    tp.init_mesh()
    torch.manual_seed(0)
    model = GPT(config).to(device=device, dtype=dtype)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    tokens, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    rows, per_token = {}, flops_per_token(model.config, seq)
    for backend in kernels.ops.BACKENDS:
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        with kernels.use_backend(backend):
            loss, norm, seconds = _steps(model, tokens, targets, steps)
        rate = batch * seq / seconds
        peak = peak_flops()
        rows[backend] = {"loss": loss, "grad_norm": norm, "step_s": round(seconds, 4), "tokens_per_s": round(rate),
                         "mfu": round(per_token * rate / peak, 3) if peak else None,
                         "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None}
    tp.destroy_mesh()
    loss_diff = abs(rows["triton"]["loss"] - rows["torch"]["loss"])
    norm_diff = abs(rows["triton"]["grad_norm"] - rows["torch"]["grad_norm"]) / rows["torch"]["grad_norm"]
    tolerance = 2e-2 if on_gpu else 1e-4  # bf16 sums in different orders / fp32
    return {"shape": f"h{config.hidden_size} L{config.num_layers} heads {config.num_heads}/{config.num_kv_heads} "
                     f"V{config.vocab_size} b{batch} s{seq} {str(dtype)[6:]}",
            "loss_diff": loss_diff, "grad_norm_rel_diff": norm_diff, **rows,
            "triton_vs_torch_speed": round(rows["torch"]["step_s"] / rows["triton"]["step_s"], 3),
            "ok": loss_diff < tolerance and norm_diff < tolerance}


ROUNDS = 5  # timing rounds of a side-by-side comparison


def interleaved(candidates: dict[str, Callable[[], float]], rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Each candidate's time (its callable measures and returns it) in each of `rounds` rounds, every round timing
    all of them in turn: a drift of clocks or power lands on every candidate alike, and a ratio taken round by round
    (`ratio`) cancels it (in H200 run 4 cuBLAS's 4096³ GEMM measured 779 and 692 TFLOP/s a minute apart)."""
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, measure in candidates.items():
            times[name].append(measure())
    return times


def ratio(base: list[float], other: list[float]) -> float:
    """other's speed-up over base: the median over rounds of base / other."""
    return statistics.median(b / o for b, o in zip(base, other, strict=True))


def _tflops(n: int, ms: float) -> float:
    return round(2 * n**3 / ms / 1e9, 1)


def square_gemm(sizes=(4096, 8192)) -> dict:
    """The Triton forward GEMM (kernels.linear_forward, no epilogue) vs cuBLAS (torch.matmul) on square bf16, timed
    in interleaved rounds; on a Hopper GPU "triton" is the persistent TMA kernel and "triton_sm80" the
    kernels.triton_ops one it replaces."""
    import triton.testing

    import kernels
    from bench.kernels import has_hopper_kernels, hopper_kernels

    def ours(a, b, hopper):
        with kernels.use_backend("triton"), hopper_kernels(hopper):
            return triton.testing.do_bench(lambda: kernels.linear_forward(a, b))

    variants = {"triton": True, **({"triton_sm80": False} if has_hopper_kernels(True) else {})}
    rows = {}
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for hopper in variants.values():  # (autotuned and compiled before the first round)
            ours(a, b, hopper)
        times = interleaved({"cublas": lambda: triton.testing.do_bench(lambda: a @ b.t()),
                             **{name: functools.partial(ours, a, b, hopper) for name, hopper in variants.items()}})
        rows[str(n)] = {"cublas_tflops": _tflops(n, statistics.median(times["cublas"]))}
        for name in variants:
            rows[str(n)].update({f"{name}_tflops": _tflops(n, statistics.median(times[name])),
                                 f"{name}_vs_cublas": round(ratio(times["cublas"], times[name]), 3)})
    return rows


_ONE_TILE = """
import json, sys, torch, triton.testing, kernels
from bench.gpu_sections import interleaved
n = int(sys.argv[1])
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
with kernels.use_backend("triton"):
    kernels.linear_forward(a, b)
    print(json.dumps(interleaved({"cublas": lambda: triton.testing.do_bench(lambda: a @ b.t()),
                                  "tile": lambda: triton.testing.do_bench(lambda: kernels.linear_forward(a, b))},
                                 rounds=3)))
"""


def tile_sweep(n: int = 4096, seconds: float = 60.0) -> dict:
    """The persistent forward GEMM on square bf16 n at each of its candidate tiles alone (TP_KERNELS_TUNE=i, a
    process each, until `seconds` are spent), timed in rounds interleaved with cuBLAS in that process: TFLOP/s and
    the ratio to cuBLAS, so that the next tuning starts from which tiles come near it."""
    from kernels.configs import PERSISTENT_TILES

    rows, cublas, deadline = {}, [], time.monotonic() + seconds
    by_area = sorted(enumerate(PERSISTENT_TILES), key=lambda item: -item[1][0] * item[1][1])  # the likeliest first
    for i, (bm, bn, bk, warps, stages) in by_area:
        name = f"{bm}x{bn}x{bk} w{warps} s{stages}"
        left = deadline - time.monotonic()
        if left < 5:
            rows[name] = "not run (time)"
            continue
        try:
            done = subprocess.run([sys.executable, "-c", _ONE_TILE, str(n)], capture_output=True, text=True,
                                  timeout=left, env={**os.environ, "TP_KERNELS_TUNE": str(i)})
        except subprocess.TimeoutExpired:
            rows[name] = "timed out"
            continue
        if done.returncode:
            rows[name] = (done.stderr.strip().splitlines() or ["failed"])[-1][:200]
            continue
        times = json.loads(done.stdout.strip().splitlines()[-1])
        cublas += times["cublas"]
        rows[name] = {"tflops": _tflops(n, statistics.median(times["tile"])),
                      "vs_cublas": round(ratio(times["cublas"], times["tile"]), 3)}
    return {"cublas_tflops": _tflops(n, statistics.median(cublas)) if cublas else None, **rows}
