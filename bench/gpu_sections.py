"""The measuring sections of bench.gpu_check that run in-process: the one-GPU GPT step, the square GEMM and its
sweep over the persistent kernel's tiles."""
import json
import math
import os
import subprocess
import sys
import time

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


def square_gemm(sizes=(4096, 8192)) -> dict:
    """The Triton forward GEMM (kernels.linear_forward, no epilogue) vs cuBLAS (torch.matmul) on square bf16; on a
    Hopper GPU "triton" is the persistent TMA kernel and "triton_sm80" the kernels.triton_ops one it replaces."""
    import triton.testing

    import kernels
    from bench.kernels import has_hopper_kernels, hopper_kernels

    variants = {"triton": True, **({"triton_sm80": False} if has_hopper_kernels(True) else {})}
    rows = {}
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        cublas = triton.testing.do_bench(lambda: a @ b.t())
        rows[str(n)] = {"cublas_tflops": round(2 * n**3 / cublas / 1e9, 1)}
        for name, hopper in variants.items():
            with kernels.use_backend("triton"), hopper_kernels(hopper):
                ours = triton.testing.do_bench(lambda: kernels.linear_forward(a, b))
            rows[str(n)].update({f"{name}_tflops": round(2 * n**3 / ours / 1e9, 1),
                                 f"{name}_vs_cublas": round(cublas / ours, 3)})
    return rows


_ONE_TILE = """
import json, sys, torch, triton.testing, kernels
n = int(sys.argv[1])
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
with kernels.use_backend("triton"):
    print(json.dumps(triton.testing.do_bench(lambda: kernels.linear_forward(a, b))))
"""


def tile_sweep(n: int = 4096, seconds: float = 60.0) -> dict:
    """The persistent forward GEMM on square bf16 n at each of its candidate tiles alone (TP_KERNELS_TUNE=i, a
    process each, until `seconds` are spent): TFLOP/s and the ratio to cuBLAS, so that the next tuning starts from
    which tiles come near it."""
    import triton.testing

    from kernels.configs import PERSISTENT_TILES

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cublas = triton.testing.do_bench(lambda: a @ b.t())
    rows, deadline = {"cublas_tflops": round(2 * n**3 / cublas / 1e9, 1)}, time.monotonic() + seconds
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
        ms = json.loads(done.stdout.strip().splitlines()[-1])
        rows[name] = {"tflops": round(2 * n**3 / ms / 1e9, 1), "vs_cublas": round(cublas / ms, 3)}
    return rows
