"""Fused kernels.linear vs torch on the local shard shapes of GPT MLP layers under tensor parallelism, and the fused
counter-based dropout + bias + residual add (kernels.dropout) vs `residual + F.dropout(x + bias)`.

    python -m bench.kernels [--out bench/results/kernels.json] [--quick] [--hidden 4096 8192] [--tokens 4096 16384]
                            [--kernels linear dropout choices fp8] [--square 4096 8192]

Per (hidden h, tokens T, TP degree): fc1 = ColumnParallel [T, h] x [4h/TP, h]^T + bias, GELU; fc1_swiglu = the same
with a fused gate/up weight [2·4h/TP, h]; fc2 = RowParallel [T, 4h/TP] x [h, 4h/TP]^T (bias added after the
all-reduce, so none here). Forward and backward (dgrad + wgrad + dbias) in bf16, and the weight-gradient GEMM
accumulated into an fp32 main_grad (fused) vs `main_grad.add_(dz.T @ x)` (matmul, then a separate add).

On a Hopper GPU the Triton backend runs its persistent TMA kernels (kernels.triton_hopper); the table then has a
column for the same calls with those off ("sm80 kernels": kernels.triton_ops' kernels, which Ampere runs). "auto"
is the same call under backend "auto" (its measured choice per primitive, kernels.choice), and "auto/fastest" the
fastest of the other columns over it: the issue's >= 0.98x, end to end.

The torch baseline is eager and unfused: F.linear, then + bias, then the activation (backward through autograd).
Dropout (`--kernels dropout`): x, residual [T/4, 4, h] and bias [h] in bf16, p = 0.1; forward, and backward (dx,
dresidual, dbias) of the output's gradient; "saved MiB" is what each keeps for backward (F.dropout its mask, one byte
per element; the fused kernel only the tokens' positions and the samples' indices: it regenerates the mask from the
counters). GB/s counts the fused kernel's minimal traffic for both (forward: read x and residual, write out; backward:
read the gradient, write dx); the fused backward's kernel is also timed alone, without a bias (dx) and with one
(dx and the bias gradient's column sums in the same pass).
On the first call of each shape the two backends' outputs are checked to give the same mask (the bits of the torch
fallback).

FP8 (`--kernels fp8`): the three GEMMs of each layer shard whose weight dims are multiples of 16 (torch._scaled_mm's
rule): fwd x·Wᵀ, dgrad dz·W, wgrad dzᵀ·x into an fp32 main_grad; and square n³ GEMMs (`--square`, forward only).
Each with kernels.fp8's recipes (kernels.FP8_RECIPES: float8 operands under dynamic scales, the amaxes and casts
included in the time, through torch._scaled_mm: cuBLASLt on a GPU) against the same GEMM in the run's dtype by torch
(bf16 cuBLAS on a GPU), and "GEMM only": torch._scaled_mm alone on operands quantized beforehand (what the scaling
costs is the difference; the wgrad's out in fp32 there, added into main_grad by the full call). On the CPU the
baseline is fp32 and _scaled_mm an eager kernel: a smoke run of the code path.

auto's choices (`--kernels choices`, GPU only): kernels.tune_linear on every layer shard under backend "auto", which
measures Triton against torch per primitive (forward, dgrad, wgrad into an fp32 main_grad) and keeps the faster
(kernels.choice); the table printed and saved is kernels.choices(): every key this device's cache holds.

GPU timings are medians of triton.testing.do_bench. Without a GPU the Triton kernels are skipped (the interpreter
says nothing about speed); the script then times only torch on CPU, on shapes shrunk by --shrink, and says so.
"""
import argparse
import contextlib
import functools
import itertools
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import kernels
from kernels import fp8 as fp8_ops
from kernels.fp8 import MULTIPLE as fp8_multiple
from kernels.fp8 import Fp8Scaling
from kernels.ops import BACKENDS

from .common import print_table as print_rows
from .common import write_json

LAYERS = ("fc1", "fc1_swiglu", "fc2")
KERNELS = ("linear", "dropout", "choices", "fp8")
CHOICE_COLUMNS = [("op", "op", "{}"), ("dtype", "dtype", "{}"), ("activation", "act", "{}"), ("bias", "bias", "{}"),
                  ("main_grad", "main_grad", "{}"), ("tokens", "T bucket", "{}"), ("groups", "E", "{}"),
                  ("N", "N", "{}"), ("K", "K", "{}"),
                  *[(f"{name}_ms", f"{name} ms", "{:.3f}") for name in BACKENDS], ("choice", "choice", "{}")]


def layer_shapes(layer, hidden, tp):
    """-> (in-features K, weight rows, activation, has_bias) of one rank's shard."""
    ffn = 4 * hidden
    if layer == "fc1":
        return hidden, ffn // tp, "gelu", True
    if layer == "fc1_swiglu":
        return hidden, 2 * ffn // tp, "swiglu", True
    return ffn // tp, hidden, None, False


def torch_reference(x, w, b, activation):
    y = F.linear(x, w)
    if b is not None:
        y = y + b
    if activation == "gelu":
        return F.gelu(y)
    if activation == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return y


def cpu_median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_timer(gpu, reps):
    if gpu:
        import triton.testing

        def timer(fn, grad_to_none=None):
            fn()  # compile + autotune outside the measurement
            torch.cuda.synchronize()
            return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
        return timer
    return lambda fn, grad_to_none=None: cpu_median_ms(lambda: (fn(), _clear(grad_to_none)), reps)


def _clear(tensors):
    for t in tensors or ():
        t.grad = None


def hopper_kernels(enabled):
    """A context with the Triton backend's persistent Hopper kernels on (the default) or off (kernels.triton_ops'
    kernels: the "kernels_sm80" row); a no-op without triton."""
    module = BACKENDS["triton"]()
    return contextlib.nullcontext() if module is None else module.use_hopper(enabled)


def has_hopper_kernels(gpu):
    """Whether this run's GPU takes the persistent Hopper kernels (then bench_case adds the sm80 kernels' row)."""
    module = BACKENDS["triton"]() if gpu else None
    return module is not None and module.hopper_device(torch.empty(0, device="cuda"))


def bench_case(layer, hidden, tokens, tp, dtype, device, candidate_backend, timer, *, sm80_row=False):
    """torch vs kernels.linear on the candidate backend (and, with sm80_row, the Triton backend with its Hopper
    kernels off) for one layer shard: forward, backward, and the wgrad into an fp32 main_grad."""
    K, rows, activation, has_bias = layer_shapes(layer, hidden, tp)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, K, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(rows, K, device=device, dtype=dtype, generator=gen) / K**0.5).requires_grad_()
    b = torch.zeros(rows, device=device, dtype=dtype).requires_grad_() if has_bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    gemm_flops = 2 * tokens * K * rows  # the SwiGLU output is half as wide, but both halves are computed
    rows_out = rows // 2 if activation == "swiglu" else rows
    gy = torch.randn(tokens, rows_out, device=device, dtype=dtype, generator=gen)
    impls = ["torch", "kernels", "auto", *(["kernels_sm80"] if sm80_row else [])]

    def under(impl, fn):
        backend = "auto" if impl == "auto" else candidate_backend  # auto: as a user runs it (measured choices)
        with kernels.use_backend(backend), hopper_kernels(impl != "kernels_sm80"):
            return fn()

    ms = {}
    for impl in impls:
        if impl == "torch":
            fwd = functools.partial(torch_reference, x, w, b, activation)
        else:
            fwd = functools.partial(under, impl, lambda: kernels.linear(x, w, b, activation=activation))
        y = fwd()
        ms[impl, "fwd"] = timer(fwd)
        ms[impl, "bwd"] = timer(functools.partial(under, impl, lambda y=y: y.backward(gy, retain_graph=True)),
                                grad_to_none=leaves)
        del y

    # Weight gradient into an fp32 main_grad: fused load-add-store vs a bf16 GEMM followed by a separate add.
    dz = torch.randn(tokens, rows, device=device, dtype=dtype, generator=gen)
    xd = x.detach()
    main_grad = torch.zeros(rows, K, device=device, dtype=torch.float32)
    ms["torch", "wgrad_main_grad"] = timer(lambda: main_grad.add_(dz.t() @ xd))
    for impl in impls[1:]:
        ms[impl, "wgrad_main_grad"] = timer(
            functools.partial(under, impl, lambda: kernels.linear_wgrad(dz, xd, main_grad=main_grad)))

    rows_json = []
    for phase, flops in (("fwd", gemm_flops), ("bwd", 2 * gemm_flops), ("wgrad_main_grad", gemm_flops)):
        ms_t, ms_k = ms["torch", phase], ms["kernels", phase]
        row = dict(layer=layer, hidden=hidden, tokens=tokens, tp=tp, M=tokens, N=rows, K=K, activation=activation,
                   bias=has_bias, phase=phase, torch_ms=ms_t, kernels_ms=ms_k, torch_tflops=flops / ms_t / 1e9,
                   kernels_tflops=flops / ms_k / 1e9, speedup=ms_t / ms_k)
        if sm80_row:
            row.update(kernels_sm80_ms=ms["kernels_sm80", phase], sm80_speedup=ms_t / ms["kernels_sm80", phase])
        fastest = min(ms[impl, phase] for impl in impls if impl != "auto")
        row.update(auto_ms=ms["auto", phase], auto_vs_fastest=fastest / ms["auto", phase])
        rows_json.append(row)
    return rows_json


def _fp8_row(what, n, k, tokens, recipe, phase, ms_base, ms_fp8, ms_gemm):
    flops = 2 * tokens * n * k
    return dict(**what, M=tokens, N=n, K=k, recipe=recipe, phase=phase, base_ms=ms_base, fp8_ms=ms_fp8,
                base_tflops=flops / ms_base / 1e9, fp8_tflops=flops / ms_fp8 / 1e9, speedup=ms_base / ms_fp8,
                gemm_only_ms=ms_gemm, gemm_only_speedup=ms_base / ms_gemm)


def bench_fp8(what, tokens, n, k, dtype, device, timer, *, phases=("fwd", "dgrad", "wgrad_main_grad")):
    """One GEMM shape's fp8 rows (per recipe and phase) against torch's GEMM in `dtype`: x [tokens, k], W [n, k]."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, dtype=dtype, generator=gen)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5
    dz = torch.randn(tokens, n, device=device, dtype=dtype, generator=gen)
    main_grad = torch.zeros(n, k, device=device, dtype=torch.float32)
    base = {"fwd": lambda: x @ w.t(), "dgrad": lambda: dz @ w, "wgrad_main_grad": lambda: main_grad.add_(dz.t() @ x)}
    base_ms = {phase: timer(base[phase]) for phase in phases}
    operands = {"fwd": (x, w.t()), "dgrad": (dz, w), "wgrad_main_grad": (dz.t(), x)}
    contraction = {"fwd": "in", "dgrad": "out", "wgrad_main_grad": "tokens"}  # (dz's float8: fp8_ops.left_dtype)
    rows = []
    for recipe in kernels.FP8_RECIPES:
        fp8 = Fp8Scaling(recipe)
        ours = {"fwd": lambda: kernels.linear_forward(x, w, fp8=fp8),
                "dgrad": lambda: kernels.linear_dgrad(dz, w, fp8=fp8),
                "wgrad_main_grad": lambda: kernels.linear_wgrad(dz, x, main_grad=main_grad, fp8=fp8)}
        for phase in phases:  # and torch._scaled_mm alone, on operands quantized beforehand
            a, b = operands[phase]
            quantized = fp8_ops.quantize(a, b, *fp8_ops.operand_amaxes(a, b, recipe), recipe,
                                         a_dtype=fp8_ops.left_dtype(recipe, contraction[phase]))
            out_dtype = torch.float32 if phase == "wgrad_main_grad" else dtype
            gemm_ms = timer(lambda q=quantized, out=out_dtype: fp8_ops.gemm(q, recipe, out))
            rows.append(_fp8_row(what, n, k, tokens, recipe, phase, base_ms[phase], timer(ours[phase]), gemm_ms))
    return rows


def fp8_rows(hiddens, tokens_list, tps, layers, squares, shrink, dtype, device, timer):
    """bench_fp8 on every layer shard torch._scaled_mm takes (weight dims multiples of 16), then the square GEMMs."""
    rows = []
    for hidden, tokens, tp, layer in itertools.product(hiddens, tokens_list, tps, layers):
        k, n, _, _ = layer_shapes(layer, hidden, tp)
        if not ((4 * hidden) % tp or k % fp8_multiple or n % fp8_multiple):
            rows += bench_fp8(dict(layer=layer, hidden=hidden, tp=tp), tokens, n, k, dtype, device, timer)
    for size in (max(n // shrink // fp8_multiple, 1) * fp8_multiple for n in squares):
        rows += bench_fp8(dict(layer="square", hidden=size, tp=1), size, size, size, dtype, device, timer,
                          phases=("fwd",))
    return rows


FP8_COLUMNS = [("layer", "layer", "{}"), ("hidden", "h", "{}"), ("tp", "tp", "{}"), ("M", "M", "{}"),
               ("N", "N", "{}"), ("K", "K", "{}"), ("phase", "phase", "{}"), ("recipe", "recipe", "{}"),
               ("base_ms", "base ms", "{:.3f}"), ("fp8_ms", "fp8 ms", "{:.3f}"),
               ("base_tflops", "base TF/s", "{:.4g}"), ("fp8_tflops", "fp8 TF/s", "{:.4g}"), ("speedup", "x", "{:.2f}"),
               ("gemm_only_ms", "GEMM only ms", "{:.3f}"), ("gemm_only_speedup", "GEMM only x", "{:.2f}")]


def print_fp8(rows, dtype):
    print(f"\nFP8 GEMMs (kernels.fp8 through torch._scaled_mm, scaling included; 'GEMM only': torch._scaled_mm on "
          f"operands quantized beforehand) vs torch's {str(dtype)[6:]} GEMM (base)")
    print_rows(rows, FP8_COLUMNS)


def measure_choices(layer, hidden, tokens, tp, dtype, device):
    """auto's measured choice of backend for one layer shard's forward, dgrad and wgrad (into a main_grad)."""
    K, rows, activation, has_bias = layer_shapes(layer, hidden, tp)
    w = torch.randn(rows, K, device=device, dtype=dtype)
    b = torch.zeros(rows, device=device, dtype=dtype) if has_bias else None
    with kernels.use_backend("auto"):
        kernels.tune_linear(w, b, activation, tokens=tokens, main_grad=True)


def print_choices(gpu):
    if not gpu:
        print("\nauto's choices: none (auto measures on CUDA only; CPU tensors take torch)")
        return []
    table = kernels.choices()
    print("\nauto's choices (kernels.choices(): the faster of the backends per key, medians of CUDA-event timings)")
    print_rows(table, CHOICE_COLUMNS)
    return table


def _saved_bytes(fn):
    """(fn(), bytes of the tensors autograd saves for backward while fn runs)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = fn()
    return out, sum(saved)


def bench_dropout(tokens, hidden, dtype, device, candidate_backend, timer, p=0.1):
    """Forward and backward of the fused dropout + bias + residual add vs residual + F.dropout(x + bias)."""
    from kernels.dropout import dropout_add, dropout_backward

    gen = torch.Generator(device=device).manual_seed(0)
    b = 4
    x, residual = (torch.randn(tokens // b, b, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
                   for _ in range(2))
    bias = torch.randn(hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    gy = torch.randn_like(x)
    samples, positions = torch.arange(b, device=device), torch.arange(tokens // b, device=device)

    def fused(backend=candidate_backend):
        with kernels.use_backend(backend):
            return dropout_add(x, residual, bias, p=p, key=1234, samples=samples, positions=positions)
    masks = [fused(backend) == residual for backend in ("torch", candidate_backend)]  # (where dropped)
    if not torch.equal(*masks):
        raise AssertionError(f"the {candidate_backend} kernel's mask differs from the torch fallback's")
    row = dict(tokens=tokens, hidden=hidden, p=p, dtype=str(dtype).replace("torch.", ""))
    elements, leaves = x.numel(), [x, residual, bias]
    for impl, fwd in (("torch", lambda: residual + F.dropout(x + bias, p, training=True)), ("fused", fused)):
        y, saved = _saved_bytes(fwd)
        row[f"{impl}_fwd_ms"] = timer(fwd)

        def backward(y=y):
            with kernels.use_backend(candidate_backend):
                y.backward(gy, retain_graph=True)
        row[f"{impl}_bwd_ms"] = timer(backward, grad_to_none=leaves)
        row[f"{impl}_saved_mib"] = saved / 2**20
        del y
    # the fused backward's kernel alone: dx without a bias, and dx with the bias gradient (one pass); the rest of
    # fused bwd ms is autograd's (the residual's gradient passed through)
    with kernels.use_backend(candidate_backend):
        for key, bias_grad in (("fused_bwd_dx_ms", False), ("fused_bwd_dx_dbias_ms", True)):
            row[key] = timer(lambda bias_grad=bias_grad: dropout_backward(
                gy, p=p, key=1234, samples=samples, positions=positions, bias_grad=bias_grad))
    size = x.element_size()
    row["fused_fwd_gbs"] = 3 * elements * size / row["fused_fwd_ms"] / 1e6
    row["fused_bwd_gbs"] = 2 * elements * size / row["fused_bwd_ms"] / 1e6
    row["fwd_speedup"], row["bwd_speedup"] = (row[f"torch_{k}_ms"] / row[f"fused_{k}_ms"] for k in ("fwd", "bwd"))
    return row


DROPOUT_COLUMNS = [("tokens", "T", "{}"), ("hidden", "h", "{}"), ("torch_fwd_ms", "torch fwd ms", "{:.3f}"),
                   ("fused_fwd_ms", "fused fwd ms", "{:.3f}"), ("fwd_speedup", "fwd x", "{:.2f}"),
                   ("torch_bwd_ms", "torch bwd ms", "{:.3f}"), ("fused_bwd_ms", "fused bwd ms", "{:.3f}"),
                   ("bwd_speedup", "bwd x", "{:.2f}"), ("fused_bwd_dx_ms", "dx ms", "{:.3f}"),
                   ("fused_bwd_dx_dbias_ms", "dx+dbias ms", "{:.3f}"), ("fused_fwd_gbs", "fused fwd GB/s", "{:.0f}"),
                   ("fused_bwd_gbs", "fused bwd GB/s", "{:.0f}"), ("torch_saved_mib", "torch saved MiB", "{:.1f}"),
                   ("fused_saved_mib", "fused saved MiB", "{:.3f}")]


def print_table(rows, candidate_label):
    cand = candidate_label
    sm80 = "kernels_sm80_ms" in rows[0]  # a Hopper GPU: the Triton backend with its sm90 kernels off, too
    header = (f"{'layer':<11}{'h':>6}{'T':>7}{'tp':>4}{'N':>7}{'K':>7}  {'phase':<16}{'torch ms':>10} "
              f"{cand + ' ms':>17} {'torch TF/s':>11} {cand + ' TF/s':>19} {'speedup':>8}"
              + (f" {'sm80 kernels ms':>16} {'sm80 x':>7}" if sm80 else "") + f" {'auto ms':>9} {'auto/fastest':>13}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['layer']:<11}{r['hidden']:>6}{r['tokens']:>7}{r['tp']:>4}{r['N']:>7}{r['K']:>7}  {r['phase']:<16}"
              f"{r['torch_ms']:>10.3f} {r['kernels_ms']:>17.3f} {r['torch_tflops']:>11.4g} {r['kernels_tflops']:>19.4g}"
              f" {r['speedup']:>7.2f}x"
              + (f" {r['kernels_sm80_ms']:>16.3f} {r['sm80_speedup']:>6.2f}x" if sm80 else "")
              + f" {r['auto_ms']:>9.3f} {r['auto_vs_fastest']:>12.2f}x")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=LAYERS)
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS,
                        help="kernels.linear's GEMMs, the fused dropout + residual add, auto's measured choices")
    parser.add_argument("--square", type=int, nargs="+", default=[4096, 8192],
                        help="square n x n x n GEMMs for the fp8 rows (shrunk as the shapes without a GPU)")
    parser.add_argument("--quick", action="store_true", help="CPU-sized shapes even on a GPU (smoke run)")
    parser.add_argument("--shrink", type=int, default=32, help="divide hidden and tokens by this without a GPU")
    parser.add_argument("--reps", type=int, default=5, help="CPU repetitions per timing")
    parser.add_argument("--candidate-backend", choices=tuple(BACKENDS), default=None,
                        help="backend for kernels.linear (default: triton on GPU, torch on CPU); on CPU 'triton' needs "
                             "TRITON_INTERPRET=1 and only smoke-tests the code path, its timings mean nothing")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)

    gpu = torch.cuda.is_available()
    shrink = args.shrink if (args.quick or not gpu) else 1
    hiddens = [max(h // shrink, 8) for h in args.hidden]
    tokens_list = [max(t // shrink, 8) for t in args.tokens]
    if gpu:
        device, dtype, backend, label = "cuda", torch.bfloat16, "triton", "triton"
        note = f"GPU {torch.cuda.get_device_name()}: Triton kernels vs torch, bf16, medians of triton.testing.do_bench"
    else:
        # bf16 matmuls on CPU are slow and unrepresentative; fp32 keeps the CPU smoke run short.
        device, dtype, backend, label = "cpu", torch.float32, "torch", "kernels[torch]"
        note = ("NO CUDA GPU: Triton kernels SKIPPED (the interpreter is not a performance proxy). "
                f"Timing only torch on CPU, fp32, shapes shrunk {shrink}x: "
                "'torch' = unfused F.linear + bias + activation, "
                "'kernels[torch]' = kernels.linear on its torch fallback. These are not GPU figures.")
    if args.candidate_backend and args.candidate_backend != backend:
        backend, label = args.candidate_backend, f"kernels[{args.candidate_backend}]"
        note = f"{note.split(':')[0]}: candidate forced to kernels.linear on the {backend} backend."
        if not gpu and backend == "triton":
            note = (f"NO CUDA GPU: kernels.linear runs the Triton kernels under the interpreter (TRITON_INTERPRET=1), "
                    f"fp32, shapes shrunk {shrink}x. Code-path smoke test only: these timings are meaningless.")
    if args.quick and gpu:
        note += f" (--quick: shapes shrunk {shrink}x)"
    print(note)
    timer = make_timer(gpu, args.reps)
    # On a Hopper GPU the Triton backend runs the persistent TMA kernels; the sm80 kernels get a column of their own.
    sm80_row = backend == "triton" and has_hopper_kernels(gpu)
    if sm80_row:
        note += "; Triton = the persistent TMA (sm90) kernels, 'sm80 kernels' = kernels.triton_ops' (use_hopper(False))"

    results, dropout = [], []
    for hidden in hiddens:
        for tokens in tokens_list:
            if "dropout" in args.kernels:
                dropout.append(bench_dropout(tokens, hidden, torch.bfloat16 if gpu else dtype, device, backend,
                                             timer))
            for tp in args.tp:
                for layer in args.layers:
                    if (4 * hidden) % tp:
                        continue
                    if "linear" in args.kernels:
                        results += bench_case(layer, hidden, tokens, tp, dtype, device, backend, timer,
                                              sm80_row=sm80_row)
                    if "choices" in args.kernels and gpu:
                        measure_choices(layer, hidden, tokens, tp, dtype, device)
    fp8 = fp8_rows(hiddens, tokens_list, args.tp, args.layers, args.square, shrink, dtype, device, timer) \
        if "fp8" in args.kernels else []
    if results:
        print_table(results, label)
    if dropout:
        print(f"\nDropout + bias + residual add (p = 0.1): torch = residual + F.dropout(x + bias), fused = "
              f"kernels.dropout.dropout_add on {label}")
        print_rows(dropout, DROPOUT_COLUMNS)
    if fp8:
        print_fp8(fp8, dtype)
    choices = print_choices(gpu) if "choices" in args.kernels else []

    if args.out:
        meta = dict(note=note, device=torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
                    gpu=gpu, dtype=str(dtype), candidate=label, torch=torch.__version__, shrink=shrink)
        try:
            import triton
            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
        write_json(args.out, dict(meta=meta, results=results, dropout=dropout, choices=choices, fp8=fp8))


if __name__ == "__main__":
    main()
