"""The experts' grouped GEMM (kernels.grouped_forward / grouped_dgrad / grouped_wgrad) on each backend.

    python -m bench.grouped [--shapes 8x4096x2048 64x2048x1408] [--rows 16384] [--out bench/results/grouped.json]

A shape EXHxF is E local experts of hidden size H and expert FFN width F: fc1 is the SwiGLU expert up-projection
(weight [E, 2F, H], output [rows, F]), fc2 the down-projection (weight [E, H, F]). `rows` routed tokens (tokens x
top-k) are spread over the experts unevenly, as a router does (a multinomial over softmax(randn) expert weights,
seeded), and each layer's three GEMMs are timed: fwd, dgrad (dx = dz·W, the activation's backward included) and
wgrad into an fp32 main_grad. Columns, where they run: "torch" (the package's torch backend: torch._grouped_mm
where it runs, bf16 on CUDA and fp32/bf16/fp16 on the CPU, else a loop of mm over the experts), "grouped_mm"
(torch._grouped_mm called directly, on a GPU: what torchtitan's experts call; wgrad with a separate fp32 add; its
error is recorded where it does not run), "triton" (the Triton backend: on a Hopper GPU the persistent TMA kernels
of kernels.grouped_hopper), "auto" (the default: the faster of the torch and Triton backends per key, measured at
the first call; "auto x" is that faster one's time over auto's) and, on a Hopper GPU, "sm80"
(kernels.grouped_triton's kernels, use_hopper(False)). Without a GPU only torch runs (fp32, shapes shrunk by
--shrink): a smoke run of the code path, not a measurement. A second table times each layer's forward + backward
(kernels.grouped_linear, wgrad into main_grad) in the input dtype and in fp8: tensorwise, tensorwise with every GEMM
casting its own operands (before the experts kept their x and dz casts), rowwise; JSON key "fp8".
"""
import argparse
import contextlib
import platform
from unittest import mock

import torch

import kernels

from .common import at_least, check_out, print_table, scratch_path, write_json
from .kernels import has_hopper_kernels, hopper_kernels, make_timer

PHASES = ("fwd", "dgrad", "wgrad_main_grad")


def _shape(text: str) -> tuple[int, int, int]:
    try:
        experts, hidden, ffn = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not EXHxF (e.g. 8x4096x2048)") from None
    if min(experts, hidden, ffn) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be >= 1")
    return experts, hidden, ffn


def routed_counts(rows: int, experts: int, seed: int = 0) -> list[int]:
    """Rows per expert as a router spreads them: uneven, summing to `rows`."""
    gen = torch.Generator().manual_seed(seed)
    choice = torch.multinomial(torch.randn(experts, generator=gen).softmax(0), rows, replacement=True, generator=gen)
    return torch.bincount(choice, minlength=experts).tolist()


def _grouped_mm_calls(x, w, dz, counts):
    """The three GEMMs through torch._grouped_mm directly (no activation: the GEMMs alone), with fp32 accumulation
    into main_grad as a separate add (it has no accumulate form)."""
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    main_grad = torch.zeros(w.shape, device=x.device, dtype=torch.float32)
    return {"fwd": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
            "dgrad": lambda: torch._grouped_mm(dz, w, offs=offs),
            "wgrad_main_grad": lambda: main_grad.add_(torch._grouped_mm(dz.t(), x, offs=offs))}


def bench_layer(layer, experts, hidden, ffn, rows, dtype, device, timer, *, triton_rows, sm80_row) -> list[dict]:
    """One expert layer's fwd / dgrad / wgrad rows: ms per backend and TFLOP/s of the best."""
    counts = routed_counts(rows, experts)
    n, k, activation = (2 * ffn, hidden, "swiglu") if layer == "fc1" else (hidden, ffn, None)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)
    w = torch.randn(experts, n, k, device=device, dtype=dtype, generator=gen) / k**0.5
    out_width = n // 2 if activation == "swiglu" else n
    gy = torch.randn(rows, out_width, device=device, dtype=dtype, generator=gen)
    _, preact = kernels.grouped_forward(x, w, counts, activation)
    dz = torch.randn(rows, n, device=device, dtype=dtype, generator=gen)
    main_grad = torch.zeros(w.shape, device=device, dtype=torch.float32)
    calls = {"fwd": lambda: kernels.grouped_forward(x, w, counts, activation),
             "dgrad": lambda: kernels.grouped_dgrad(gy, w, counts, preact, activation),
             "wgrad_main_grad": lambda: kernels.grouped_wgrad(dz, x, counts, main_grad=main_grad)}
    variants = {"torch": ("torch", True), **({"triton": ("triton", True), "auto": ("auto", True)} if triton_rows
                                             else {}), **({"sm80": ("triton", False)} if sm80_row else {})}
    ms = {}
    for name, (backend, hopper) in variants.items():
        with kernels.use_backend(backend), hopper_kernels(hopper):
            ms.update({(name, phase): timer(calls[phase]) for phase in PHASES})
    errors = {}
    if device == "cuda":
        for phase, call in _grouped_mm_calls(x, w, dz, counts).items():
            try:
                ms["grouped_mm", phase] = timer(call)
            except (RuntimeError, NotImplementedError) as e:  # not on this GPU / dtype / layout: say why
                errors[phase] = str(e).splitlines()[0][:200]
    flops = 2 * rows * n * k
    table = []
    for phase in PHASES:
        row = dict(layer=layer, experts=experts, hidden=hidden, ffn=ffn, rows=rows, min_rows=min(counts),
                   max_rows=max(counts), phase=phase)
        row.update({f"{name}_ms": ms[name, phase] for name in ("torch", "grouped_mm", "triton", "sm80", "auto")
                    if (name, phase) in ms})
        timed = {key: v for key, v in row.items() if key.endswith("_ms") and key != "auto_ms"}
        row["best_tflops"] = flops / min(timed.values()) / 1e9
        if "triton_ms" in row:
            row["triton_vs_best_other"] = min(v for key, v in timed.items() if key != "triton_ms") / row["triton_ms"]
            # auto's candidates are the torch backend and the Triton one (kernels.choice): >= 0.98 is the aim
            row["auto_vs_faster"] = min(row["torch_ms"], row["triton_ms"]) / row["auto_ms"]
        if phase in errors:
            row["grouped_mm_error"] = errors[phase]
        table.append(row)
    return table


KEEPING = next(name for name, recipe in kernels.fp8.FP8_RECIPES.items() if not recipe.rowwise)  # (keeps its casts)
FP8_VARIANTS = ("bf16", *kernels.fp8.FP8_RECIPES, f"{KEEPING}_per_gemm")


def bench_fp8(layer, experts, hidden, ffn, rows, dtype, device, timer) -> dict | None:
    """One expert layer's forward + backward through kernels.grouped_linear (wgrad into an fp32 main_grad) in the
    input dtype and in each fp8 recipe, tensorwise also with every GEMM casting its own operands (what it ran before
    keeping each expert's x and dz casts for the wgrad): ms each. None where a weight dim is not a multiple of 16
    (torch._scaled_mm's rule)."""
    n, k, activation = (2 * ffn, hidden, "swiglu") if layer == "fc1" else (hidden, ffn, None)
    if n % 16 or k % 16:
        return None
    counts = routed_counts(rows, experts)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(experts, n, k, device=device, dtype=dtype, generator=gen) / k**0.5).requires_grad_()
    w.main_grad = torch.zeros(w.shape, device=device, dtype=torch.float32)
    gy = torch.randn(rows, n // 2 if activation == "swiglu" else n, device=device, dtype=dtype, generator=gen)

    def step(recipe):
        kernels.grouped_linear(x, w, counts, activation=activation, fp8_recipe=recipe).backward(gy)
    row = dict(layer=layer, experts=experts, hidden=hidden, ffn=ffn, rows=rows)
    for variant in FP8_VARIANTS:
        recipe = None if variant == "bf16" else variant.removesuffix("_per_gemm")  # (the per-GEMM casts: patched)
        per_gemm = mock.patch.object(kernels.fp8, "keeps_operands", lambda fp8: False)
        with per_gemm if variant.endswith("_per_gemm") else contextlib.nullcontext():
            row[f"{variant}_ms"] = timer(lambda: step(recipe), grad_to_none=[x])
    row["tensorwise_speedup"] = row["bf16_ms"] / row["tensorwise_ms"]
    row["kept_casts_speedup"] = row["tensorwise_per_gemm_ms"] / row["tensorwise_ms"]
    return row


FP8_COLUMNS = [("layer", "layer", "{}"), ("experts", "E", "{}"), ("hidden", "h", "{}"), ("ffn", "F", "{}"),
               ("rows", "rows", "{}"), ("bf16_ms", "bf16 ms", "{:.3f}"), ("tensorwise_ms", "tensorwise ms", "{:.3f}"),
               ("tensorwise_per_gemm_ms", "per-GEMM casts ms", "{:.3f}"), ("rowwise_ms", "rowwise ms", "{:.3f}"),
               ("tensorwise_speedup", "bf16/tensorwise", "{:.2f}"), ("kept_casts_speedup", "kept casts x", "{:.2f}")]


COLUMNS = [("layer", "layer", "{}"), ("experts", "E", "{}"), ("hidden", "h", "{}"), ("ffn", "F", "{}"),
           ("rows", "rows", "{}"), ("max_rows", "max/expert", "{}"), ("phase", "phase", "{}"),
           ("torch_ms", "torch ms", "{:.3f}"), ("grouped_mm_ms", "_grouped_mm ms", "{:.3f}"),
           ("triton_ms", "triton ms", "{:.3f}"), ("sm80_ms", "sm80 ms", "{:.3f}"),
           ("auto_ms", "auto ms", "{:.3f}"), ("best_tflops", "best TF/s", "{:.1f}"),
           ("triton_vs_best_other", "triton x", "{:.2f}"), ("auto_vs_faster", "auto x", "{:.2f}")]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shape, nargs="+", default=[(8, 4096, 2048), (64, 2048, 1408)],
                   help="EXHxF: local experts x hidden x expert FFN width")
    p.add_argument("--rows", type=at_least(1), default=16384, help="routed rows (tokens x top-k) in all")
    p.add_argument("--shrink", type=at_least(1), default=32, help="divide hidden, FFN and rows by this without a GPU")
    p.add_argument("--reps", type=at_least(1), default=3, help="CPU repetitions per timing")
    p.add_argument("--out", default=scratch_path("grouped.json"))
    args = p.parse_args(argv)
    check_out(p, "--out", args.out)
    gpu = torch.cuda.is_available()
    shrink = 1 if gpu else args.shrink
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    timer, hopper = make_timer(gpu, args.reps), has_hopper_kernels(gpu)
    print(f"{'GPU ' + torch.cuda.get_device_name() if gpu else 'NO CUDA GPU: torch only, fp32, shrunk'}: "
          f"the experts' grouped GEMMs, {str(dtype)[6:]}")
    meta = dict(device=torch.cuda.get_device_name() if gpu else platform.processor() or "cpu", gpu=gpu,
                dtype=str(dtype), torch=torch.__version__, shrink=shrink, hopper_kernels=hopper)
    rows, fp8_rows = [], []
    for experts, hidden, ffn in args.shapes:
        for layer in ("fc1", "fc2"):
            sizes = (experts, max(hidden // shrink, 8), max(ffn // shrink, 8), max(args.rows // shrink, experts))
            rows += bench_layer(layer, *sizes, dtype, device, timer, triton_rows=gpu, sm80_row=hopper)
            fp8_rows += [row for row in [bench_fp8(layer, *sizes, dtype, device, timer)] if row]
            write_json(args.out, dict(meta=meta, results=rows, fp8=fp8_rows))  # after every layer: a timed-out run
    print_table(rows, COLUMNS)                                                   # keeps these
    print("\nforward + backward of a layer in fp8 (kernels.grouped_linear, wgrad into main_grad):")
    print_table(fp8_rows, FP8_COLUMNS)
    return rows


if __name__ == "__main__":
    main()
