"""The experts' grouped GEMM (kernels.grouped_linear) against a float64 loop over the groups.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 (conftest), forced with kernels.use_backend("triton");
the torch fallback (torch._grouped_mm where this torch runs it, else a loop) is checked the same way. Shapes stay
tiny and odd: groups of 0, 1 and many rows (more than one 32-row tile), K and N not multiples of the tile.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import triton_ops

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"  # compiled kernels on the GPU
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}
COUNTS = [5, 0, 37, 1]  # an empty expert, a one-row expert, one spanning two row tiles


def reference(x, w, counts, activation):
    outs, start = [], 0
    for e, n in enumerate(counts):
        z = x[start:start + n] @ w[e].t()
        start += n
        if activation == "swiglu":
            gate, up = z.chunk(2, dim=-1)
            z = F.silu(gate) * up
        elif activation == "gelu":
            z = F.gelu(z)
        outs.append(z)
    return torch.cat(outs)


def rel_err(actual, expected):
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def inputs(counts, K, N, dtype, activation, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if activation == "swiglu" else N
    x = torch.randn(sum(counts), K, generator=g)
    w = torch.randn(len(counts), rows, K, generator=g) / K**0.5
    return x.to(DEVICE, dtype).requires_grad_(), w.to(DEVICE, dtype).requires_grad_()


def check(x, w, counts, activation, dtype, backend):
    with kernels.use_backend(backend):
        y = kernels.grouped_linear(x, w, counts, activation=activation)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
        y.backward(gy)
    xr, wr = (t.detach().double().requires_grad_() for t in (x, w))
    y_ref = reference(xr, wr, counts, activation)
    y_ref.backward(gy.double())
    assert y.dtype == dtype and y.shape == y_ref.shape
    for what, a, b in (("y", y, y_ref), ("dx", x.grad, xr.grad), ("dw", w.grad, wr.grad)):
        assert rel_err(a, b) < TOL[dtype], f"{what}: {rel_err(a, b):.2e}"
    assert not w.grad[1].any(), "the expert without rows gets a zero gradient"


@pytest.mark.parametrize("activation", [None, "swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_triton_grouped_linear(dtype, activation):
    before = triton_ops.LAUNCHES.copy()
    check(*inputs(COUNTS, 20, 18, dtype, activation), COUNTS, activation, dtype, "triton")
    assert triton_ops.LAUNCHES["grouped_gemm"] == before["grouped_gemm"] + 2  # forward, dgrad
    assert triton_ops.LAUNCHES["grouped_wgrad"] == before["grouped_wgrad"] + 1


@pytest.mark.parametrize("K,N", [(20, 18), (16, 8)])  # a loop (unaligned rows), torch._grouped_mm (aligned)
@pytest.mark.parametrize("activation", [None, "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_torch_grouped_linear(dtype, activation, K, N):
    check(*inputs(COUNTS, K, N, dtype, activation), COUNTS, activation, dtype, "torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_main_grad_accumulates_and_empty_inputs(backend):
    """wgrad accumulates into an fp32 main_grad over two backward passes (weight.grad stays None); no rows at all
    leaves it unchanged."""
    dtype = torch.bfloat16 if backend == "triton" else torch.float32
    x, w = inputs(COUNTS, 20, 18, dtype, "swiglu")
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEVICE)
    expected = torch.zeros(w.shape, dtype=torch.float64, device=DEVICE)
    with kernels.use_backend(backend):
        for seed in (1, 2):
            y = kernels.grouped_linear(x, w, COUNTS, activation="swiglu")
            gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
            y.backward(gy)
            wr = w.detach().double().requires_grad_()
            reference(x.detach().double(), wr, COUNTS, "swiglu").backward(gy.double())
            expected += wr.grad
        assert w.grad is None and rel_err(w.main_grad, expected) < TOL[dtype]
        before = w.main_grad.clone()
        empty = torch.zeros(0, 20, dtype=dtype, device=DEVICE, requires_grad=True)
        y = kernels.grouped_linear(empty, w, [0] * 4, activation="swiglu")
        y.sum().backward()
        assert y.shape == (0, 18) and torch.equal(w.main_grad, before) and empty.grad.shape == (0, 20)


def test_noncontiguous_weight():
    """A transposed view (HF's experts stored [E, K, N] elsewhere) takes the strided path on both backends."""
    x, w = inputs(COUNTS, 20, 18, torch.float32, None)
    w_t = w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not w_t.is_contiguous()
    for backend in ("triton", "torch"):
        x.grad = None
        check(x, w_t, COUNTS, None, torch.float32, backend)
        w_t.grad = None


def test_bad_input():
    x, w = inputs(COUNTS, 20, 18, torch.float32, None)
    with pytest.raises(ValueError, match=r"counts \[5, 0, 37\] must give the rows of each of the 4 groups"):
        kernels.grouped_linear(x, w, [5, 0, 37])
    with pytest.raises(ValueError, match=r"counts \[5, 0, 36, 1\] must give .* summing to x's 43 rows"):
        kernels.grouped_linear(x, w, [5, 0, 36, 1])
    with pytest.raises(ValueError, match=r"grouped linear needs x \[M, K\] and weight \[E, N, K\]"):
        kernels.grouped_linear(x, w[0], COUNTS)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        kernels.grouped_linear(x, w, COUNTS, activation="tanh")
    w.main_grad = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="main_grad must be an fp32/fp64 tensor of shape"):
        kernels.grouped_linear(x, w, COUNTS).sum().backward()


def test_counts_as_a_tensor_and_under_torch_compile():
    """Counts given as an int tensor (an expert dispatch's, never read on the host by the Triton kernels) give the
    list's result; under torch.compile (fullgraph) the primitives are custom ops, forward and both gradients equal."""
    x, w = inputs(COUNTS, 20, 18, torch.float32, "swiglu")
    want = kernels.grouped_linear(x, w, COUNTS, activation="swiglu")
    want.square().sum().backward()
    grads = x.grad, w.grad
    for counts in (torch.tensor(COUNTS), torch.tensor(COUNTS, device=DEVICE)):
        fn = torch.compile(lambda x, w, c: kernels.grouped_linear(x, w, c, activation="swiglu"), fullgraph=True,
                           backend="aot_eager")
        for f in (kernels.grouped_linear, fn):
            x.grad = w.grad = None
            got = f(x, w, counts, activation="swiglu") if f is kernels.grouped_linear else f(x, w, counts)
            got.square().sum().backward()
            assert torch.equal(got, want) and torch.equal(x.grad, grads[0]) and torch.equal(w.grad, grads[1])
    with pytest.raises(ValueError, match=r"counts must be an integer tensor \[4\], got torch.float32 \(4,\)"):
        kernels.grouped_linear(x, w, torch.tensor(COUNTS, dtype=torch.float32))
