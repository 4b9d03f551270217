"""kernels.triton_epilogue, auto's third candidate (torch's GEMM with Triton's elementwise passes), against a
float64 torch reference for every activation, forward, dgrad and wgrad (Triton's interpreter without a GPU), and
which passes it launches."""
import pytest
import torch

import kernels
from kernels import ops, triton_epilogue, triton_ops
from tests.test_kernels import ALL_ACTIVATIONS, TOL, reference, rel_err

DEVICE = "cuda" if torch.cuda.is_available() and not triton_ops.INTERPRET else "cpu"
M, K, N = 37, 24, 20  # odd token count; widths not multiples of the 32-wide interpreter block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
def test_matches_float64_and_runs_one_elementwise_pass_each_way(activation, dtype):
    g = torch.Generator().manual_seed(0)
    rows = 2 * N if activation == "swiglu" else N
    x, w, b = torch.randn(M, K, generator=g), torch.randn(rows, K, generator=g) / K**0.5, torch.randn(rows, generator=g)
    x, w, b = (t.to(DEVICE, dtype) for t in (x, w, b))
    before = dict(triton_ops.LAUNCHES)
    y, preact = triton_epilogue.linear_forward(x, w, b, activation)
    gy = torch.randn(y.shape, generator=g).to(DEVICE, dtype)
    dx, dz = triton_epilogue.linear_dgrad(gy, w, preact, activation)
    dw = triton_epilogue.linear_wgrad(dz, x)
    fused = activation is not None
    assert triton_ops.LAUNCHES["act_fwd"] - before.get("act_fwd", 0) == fused
    assert triton_ops.LAUNCHES["act_bwd"] - before.get("act_bwd", 0) == fused
    assert triton_ops.LAUNCHES["linear_fwd"] == before.get("linear_fwd", 0)  # the GEMMs are torch's
    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    y_ref = reference(*leaves, activation)
    y_ref.backward(gy.double())
    tol = TOL[dtype]
    assert y.dtype == dtype and rel_err(y, y_ref) < tol
    if fused:
        assert rel_err(preact, torch.nn.functional.linear(*leaves).detach()) < tol
    assert rel_err(dx, leaves[0].grad) < tol and rel_err(dw, leaves[1].grad) < tol


def test_is_a_backend_auto_measures_and_one_that_can_be_forced():
    assert ops.BACKENDS["triton_epilogue"]() is triton_epilogue
    x = torch.randn(8, 16, device=DEVICE).requires_grad_()
    w = torch.randn(12, 16, device=DEVICE)
    with kernels.use_backend("triton_epilogue"):
        before = triton_ops.LAUNCHES["act_fwd"]
        y = kernels.linear(x, w, activation="gelu")
        assert triton_ops.LAUNCHES["act_fwd"] == before + 1
    y.sum().backward()
    assert torch.allclose(y, torch.nn.functional.gelu(x @ w.t()), atol=1e-5)


def _swiglu_loss(x, w, b):
    return kernels.linear(x, w, b, activation="swiglu").float().square().sum()


def test_compiles_with_its_passes_as_opaque_ops():
    """Forced under torch.compile(fullgraph=True): the elementwise Triton passes are custom ops in the graph (Dynamo
    does not trace their launches); forward and gradients equal eager, and the passes still run."""
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(2 * N, K, generator=g), torch.randn(2 * N, generator=g)
    eager, compiled = ([t.to(DEVICE).requires_grad_() for t in (x, w, b)] for _ in range(2))
    with kernels.use_backend("triton_epilogue"):
        want = _swiglu_loss(*eager)
        want.backward()
        torch._dynamo.reset()
        before = dict(triton_ops.LAUNCHES)
        got = torch.compile(_swiglu_loss, fullgraph=True, backend="aot_eager")(*compiled)
        got.backward()
    assert [triton_ops.LAUNCHES[k] - before.get(k, 0) for k in ("act_fwd", "act_bwd")] == [1, 1]
    assert rel_err(got, want.double()) < 1e-6
    for a, e in zip(compiled, eager):
        assert rel_err(a.grad, e.grad.double()) < 1e-6
