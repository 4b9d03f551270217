"""The persistent TMA kernels of kernels.triton_hopper against a float64 torch reference, and when they run.

Without a GPU they run under TRITON_INTERPRET=1 (Triton 3.9's interpreter runs host tensor descriptors, their
zero-filled out-of-bounds loads and clipped stores, the config pre_hook and the persistent tile loop), with
`hopper_device` swapped to accept CPU tensors. Shapes are odd in the token count and not multiples of the 32x32x32
interpreter tile in the feature widths, so partial tiles and the several tiles per program are exercised.
`runs_hopper` (a Hopper GPU, use_hopper on) is tested with the device capability stubbed. What the
interpreter cannot show (TMA hardware, wgmma, the pipeliner, shared memory) the AOT test compiles for sm_90a
(tests/test_kernels_compile.py); speed waits for a GPU (docs/gpu.md).
"""
import os
import types

import pytest
import torch

import kernels
from kernels import triton_hopper, triton_ops
from tests.test_kernels import ALL_ACTIVATIONS, TOL, reference, rel_err

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"
HOPPER_DEVICE = triton_hopper.hopper_device  # (the fixture swaps it)
M, K, N = 77, 40, 56  # tokens odd; feature widths multiples of 8 (TMA's 16-byte rule), not of the tile


@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    if CUDA and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the persistent TMA kernels need a Hopper GPU (or the interpreter)")
    if not CUDA:
        monkeypatch.setattr(triton_hopper, "hopper_device", lambda t: True)
    with kernels.use_backend("triton"):
        yield


def hopper_launches():
    return sum(n for name, n in triton_ops.LAUNCHES.items() if name.startswith("hopper_"))


def operands(activation, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if activation == "swiglu" else N
    x, w = torch.randn(M, K, generator=g), torch.randn(rows, K, generator=g) / K**0.5
    b = torch.randn(rows, generator=g) if bias else None
    return [None if t is None else t.to(DEVICE, dtype) for t in (x, w, b)]


CASES = [(act, torch.bfloat16) for act in ALL_ACTIVATIONS] + [("gelu", torch.float16), ("swiglu", torch.float16)]


@pytest.mark.parametrize("activation, dtype", CASES, ids=[f"{a}-{str(d)[6:]}" for a, d in CASES])
def test_forward_dgrad_wgrad_match_float64(activation, dtype):
    x, w, b = operands(activation, dtype)
    before = triton_ops.LAUNCHES.copy()
    y, preact = triton_hopper.linear_forward(x, w, b, activation)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    dx, dz = triton_hopper.linear_dgrad(gy, w, preact, activation)
    main_grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    start = main_grad.clone()
    assert triton_hopper.linear_wgrad(dz, x, main_grad=main_grad) is None
    dw = triton_hopper.linear_wgrad(dz, x)
    forward = "hopper_swiglu_fwd" if activation == "swiglu" else "hopper_fwd"
    for name, count in ((forward, 1), ("hopper_dgrad", 1), ("hopper_wgrad", 2)):
        assert triton_ops.LAUNCHES[name] == before[name] + count, name

    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    y_ref = reference(*leaves, activation)
    y_ref.backward(gy.double())
    tol = TOL[dtype]
    assert y.dtype == dtype and rel_err(y, y_ref) < tol
    if activation is not None:
        assert rel_err(preact, torch.nn.functional.linear(*leaves).detach()) < tol
    assert rel_err(dx, leaves[0].grad) < tol
    assert rel_err(dw, leaves[1].grad) < tol
    assert main_grad.dtype == torch.float32 and rel_err(main_grad - start, leaves[1].grad) < tol


def test_forward_without_bias_and_autograd_through_kernels_linear():
    x, w, _ = operands("gelu", torch.bfloat16, bias=False)
    y, preact = triton_hopper.linear_forward(x, w, None, None)
    assert preact is None and rel_err(y, x.double() @ w.double().T) < TOL[torch.bfloat16]
    before = hopper_launches()
    leaf = x.detach().requires_grad_()
    y = kernels.linear(leaf, w, activation="silu")  # the backend's own dispatch (ops.BACKENDS)
    y.backward(torch.ones_like(y))  # (y.sum()'s gradient would be expanded, stride 0: not TMA-ready)
    assert hopper_launches() == before + 2  # forward and dgrad; the weight is a constant: no wgrad
    assert leaf.grad.shape == x.shape


def _linear_loss(x, w, b):
    return kernels.linear(x, w, b, activation="gelu").float().square().sum()


def test_forced_triton_compiles_with_the_kernels_as_opaque_ops():
    """torch.compile(fullgraph=True) of a linear on the forced Triton backend: Dynamo cannot trace the TMA checks
    (a data pointer) and host descriptors, so the Hopper entry points are custom ops in the graph; the compiled
    forward and gradients equal eager and still run the Hopper kernels."""
    x, w, b = operands("gelu", torch.bfloat16)
    eager = [t.detach().requires_grad_() for t in (x, w, b)]
    _linear_loss(*eager).backward()
    torch._dynamo.reset()
    compiled = [t.detach().requires_grad_() for t in (x, w, b)]
    before = hopper_launches()
    torch.compile(_linear_loss, fullgraph=True, backend="aot_eager")(*compiled).backward()
    assert hopper_launches() == before + 3  # forward, dgrad, wgrad (the bias gradient is a torch sum)
    for got, want in zip(compiled, eager):
        assert torch.equal(got.grad, want.grad)
    dz, main_grad = eager[0].grad.new_ones(M, N), torch.zeros(w.shape, device=w.device)  # main_grad: mutated
    torch.compile(lambda dz, x: triton_hopper.linear_wgrad(dz, x, main_grad=main_grad), fullgraph=True,
                  backend="aot_eager")(dz, x)
    assert hopper_launches() == before + 4
    assert rel_err(main_grad, dz.double().T @ x.double()) < TOL[torch.bfloat16]


def test_auto_under_compile_leaves_the_linear_to_torch():
    """Backend "auto" under torch.compile: the traced graph holds torch's matmul and epilogue (cuBLAS, which the
    compiler fuses around) rather than the Triton kernels that eager measurement would pick."""
    x, w, b = operands("gelu", torch.bfloat16)
    before = dict(triton_ops.LAUNCHES)
    torch._dynamo.reset()
    with kernels.use_backend("auto"):
        got = torch.compile(_linear_loss, fullgraph=True, backend="aot_eager")(x, w, b)
    assert dict(triton_ops.LAUNCHES) == before
    assert rel_err(got, reference(x.double(), w.double(), b.double(), "gelu").square().sum()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("case", ["width not a multiple of 8", "fp32", "use_hopper(False)", "strided x"])
def test_takes_triton_ops_kernels_where_tma_cannot(case):
    """Operands outside TMA's rules (or the kernels switched off) run kernels.triton_ops' kernels, same results."""
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    x, w, b = operands("gelu", dtype)
    if case == "width not a multiple of 8":
        x, w = x[:, :-3].contiguous(), w[:, :-3].contiguous()
    if case == "strided x":
        x = x.t().contiguous().t()
    before_hopper, before_old = hopper_launches(), triton_ops.LAUNCHES["linear_fwd"]
    with triton_hopper.use_hopper(case != "use_hopper(False)"):
        y, _ = triton_hopper.linear_forward(x, w, b, "gelu")
    assert hopper_launches() == before_hopper and triton_ops.LAUNCHES["linear_fwd"] == before_old + 1
    assert rel_err(y, reference(x.double(), w.double(), b.double(), "gelu")) < TOL[dtype]


def test_bad_input_still_raises_the_old_line():
    x, w, _ = operands(None, torch.bfloat16)
    with pytest.raises(ValueError, match="shape mismatch"):
        triton_hopper.linear_forward(x, w[:, :-8].contiguous())


@pytest.mark.parametrize("major, enabled, expected", [(9, True, True), (8, True, False), (10, True, False),
                                                      (9, False, False)])
def test_runs_hopper_on_sm90_only(monkeypatch, major, enabled, expected):
    monkeypatch.setattr(triton_hopper, "hopper_device", HOPPER_DEVICE)
    monkeypatch.setattr(triton_hopper, "_capability_major", lambda index: major)
    gpu_tensor = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    with triton_hopper.use_hopper(enabled):
        assert triton_hopper.runs_hopper(gpu_tensor) is expected
    assert not triton_hopper.runs_hopper(torch.zeros(1))  # CPU tensors: only the tests' swap lets them in


def test_bench_kernels_adds_the_sm80_kernels_column():
    """bench.kernels on a Hopper GPU: a column for the Triton backend with these kernels off (here on CPU, torch)."""
    from bench import kernels as bench_kernels

    rows = bench_kernels.bench_case("fc1", 16, 8, 1, torch.float32, "cpu", "torch", bench_kernels.make_timer(False, 1),
                                    sm80_row=True)
    assert [r["phase"] for r in rows] == ["fwd", "bwd", "wgrad_main_grad"]
    assert all(r["kernels_sm80_ms"] > 0 and r["sm80_speedup"] > 0 for r in rows)
    assert triton_hopper.runs_hopper(torch.zeros(1, device=DEVICE))  # use_hopper(False) was scoped to its calls


# ------------------------------------------------------------------ the experts' grouped GEMMs (kernels.grouped_hopper)
GROUP_COUNTS = [37, 0, 1, 70]  # a group over two row tiles, an empty one, one row, one over three tiles: 108 rows
GROUPED_CASES = [(None, torch.bfloat16), ("gelu", torch.bfloat16), ("swiglu", torch.bfloat16),
                 ("swiglu", torch.float16)]


def grouped_reference(x, w, activation):
    """float64 per-group reference: act(x_e @ w_eᵀ), rows in GROUP_COUNTS' groups."""
    outs = [reference(x_e, w_e, None, activation) for x_e, w_e in zip(x.split(GROUP_COUNTS), w)]
    return torch.cat(outs)


@pytest.mark.parametrize("activation, dtype", GROUPED_CASES, ids=[f"{a}-{str(d)[6:]}" for a, d in GROUPED_CASES])
def test_grouped_forward_dgrad_wgrad_match_float64(activation, dtype):
    """Forward, dgrad and wgrad (fresh and into an fp32 main_grad) of kernels.grouped on the persistent TMA kernels:
    row tiles that end inside the next group, weight tiles past an expert's last row or column (K, N not multiples
    of the 32-wide tile), an empty expert (zero gradient, main_grad untouched)."""
    g = torch.Generator().manual_seed(0)
    rows = 2 * N if activation == "swiglu" else N
    x = torch.randn(sum(GROUP_COUNTS), K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(len(GROUP_COUNTS), rows, K, generator=g) / K**0.5).to(DEVICE, dtype)
    before = triton_ops.LAUNCHES.copy()
    y, preact = kernels.grouped_forward(x, w, GROUP_COUNTS, activation)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    dx, dz = kernels.grouped_dgrad(gy, w, GROUP_COUNTS, preact, activation)
    main_grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    start = main_grad.clone()
    assert kernels.grouped_wgrad(dz, x, GROUP_COUNTS, main_grad=main_grad) is None
    dw = kernels.grouped_wgrad(dz, x, GROUP_COUNTS)
    for name, count in (("hopper_grouped_gemm", 2), ("hopper_grouped_wgrad", 2), ("grouped_gemm", 0),
                        ("grouped_wgrad", 0)):
        assert triton_ops.LAUNCHES[name] == before[name] + count, name

    leaves = [t.double().requires_grad_() for t in (x, w)]
    y_ref = grouped_reference(*leaves, activation)
    y_ref.backward(gy.double())
    tol = TOL[dtype]
    assert y.dtype == dtype and y.shape == y_ref.shape and rel_err(y, y_ref) < tol
    assert rel_err(dx, leaves[0].grad) < tol
    assert rel_err(dw, leaves[1].grad) < tol and not dw[1].any()
    assert rel_err(main_grad - start, leaves[1].grad) < tol and torch.equal(main_grad[1], start[1])


@pytest.mark.parametrize("case", ["fp32", "width not a multiple of 8", "use_hopper(False)"])
def test_grouped_takes_the_sm80_kernels_where_tma_cannot(case):
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    width = K - 3 if case == "width not a multiple of 8" else K
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(GROUP_COUNTS), width, generator=g).to(DEVICE, dtype)
    w = torch.randn(len(GROUP_COUNTS), N, width, generator=g).to(DEVICE, dtype)
    before = triton_ops.LAUNCHES.copy()
    with triton_hopper.use_hopper(case != "use_hopper(False)"):
        y, _ = kernels.grouped_forward(x, w, GROUP_COUNTS)
    assert triton_ops.LAUNCHES["hopper_grouped_gemm"] == before["hopper_grouped_gemm"]
    assert triton_ops.LAUNCHES["grouped_gemm"] == before["grouped_gemm"] + 1
    assert rel_err(y, grouped_reference(x.double(), w.double(), None)) < TOL[dtype]


def test_grouped_linear_autograd_with_device_counts_and_main_grad_matches_torch():
    """kernels.grouped_linear as the MoE layers call it (counts a tensor, as an expert dispatch returns them; the
    weight's gradient into its main_grad) on the Hopper kernels, against the torch backend."""
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(sum(GROUP_COUNTS), K, generator=g).to(DEVICE, torch.bfloat16)
    w0 = (torch.randn(len(GROUP_COUNTS), 2 * N, K, generator=g) / K**0.5).to(DEVICE, torch.bfloat16)
    counts = torch.tensor(GROUP_COUNTS, device=DEVICE)
    results = {}
    for backend in ("triton", "torch"):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        w.main_grad = torch.zeros(w.shape, device=DEVICE)
        before = triton_ops.LAUNCHES.copy()
        with kernels.use_backend(backend):
            y = kernels.grouped_linear(x, w, counts, activation="swiglu")
            y.float().square().sum().backward()
        hopper = sum(triton_ops.LAUNCHES[k] - before[k] for k in ("hopper_grouped_gemm", "hopper_grouped_wgrad"))
        assert hopper == (3 if backend == "triton" else 0) and w.grad is None
        results[backend] = (y, x.grad, w.main_grad)
    for got, want in zip(results["triton"], results["torch"]):
        assert rel_err(got, want) < TOL[torch.bfloat16]
