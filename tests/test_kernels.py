"""Fused linear kernels against a float64 torch reference.

Without CUDA the real Triton kernels run under TRITON_INTERPRET=1 (set by conftest before any import), so every
test forces the Triton backend; shapes stay small and odd (the interpreter is numpy, ~0.5 s for 256³). Tests that
need compiled kernels or autotuning are skipped without CUDA.
"""
import functools
import os

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import configs, ops, torch_ops, triton_hopper, triton_ops

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"  # compiled kernels on the GPU
DEVICE = "cuda" if CUDA else "cpu"
requires_cuda = pytest.mark.skipif(not CUDA, reason="compiled Triton kernels / autotune need a CUDA GPU")

# Relative-norm tolerances: a few roundings of the output dtype's epsilon (bf16 eps = 7.8e-3, fp16 eps = 9.8e-4).
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-9}
ELEMENTWISE = [None, "gelu", "gelu_tanh", "silu", "relu"]
ALL_ACTIVATIONS = ELEMENTWISE + ["swiglu"]


@pytest.fixture(autouse=True)
def triton_backend():
    with kernels.use_backend("triton"):
        yield


def reference(x, weight, bias, activation):
    """float64 eager reference, independent of kernels.torch_ops."""
    z = F.linear(x, weight, bias)
    if activation is None:
        return z
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    if activation == "relu":
        return F.relu(z)
    gate, up = z.chunk(2, dim=-1)
    return F.silu(gate) * up


def rel_err(actual, expected):
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def make_inputs(batch, K, N, dtype, activation, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if activation == "swiglu" else N
    x = torch.randn(*batch, K, generator=g)
    w = torch.randn(rows, K, generator=g) / K**0.5
    b = torch.randn(rows, generator=g) if bias else None
    return [None if t is None else t.to(DEVICE, dtype) for t in (x, w, b)]


def check_against_reference(x, w, b, activation, dtype, grad_seed=1):
    """Forward and x/W/b gradients of kernels.linear vs float64 autograd on the same (rounded) inputs."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    launches = sum(triton_ops.LAUNCHES.values())
    y = kernels.linear(leaves[0], leaves[1], leaves[2], activation=activation)
    assert y.dtype == dtype
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)).to(DEVICE, dtype)
    y.backward(gy)
    assert sum(triton_ops.LAUNCHES.values()) >= launches + 3, "forward, dgrad and wgrad kernels must all run"

    ref_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    y_ref = reference(*ref_leaves, activation)
    y_ref.backward(gy.double())

    tol = TOL[dtype]
    assert y.shape == y_ref.shape
    assert rel_err(y, y_ref) < tol, "output"
    for name, leaf, ref in zip("xwb", leaves, ref_leaves):
        if leaf is None:
            continue
        assert leaf.grad is not None and leaf.grad.dtype == dtype, name
        assert rel_err(leaf.grad, ref.grad) < tol, f"grad {name}: {rel_err(leaf.grad, ref.grad):.2e}"


@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_linear_matches_reference(dtype, activation):
    # Odd shapes (37 tokens... here 2×19 = 38 rows, K = 45, N = 70) exercise every mask; batch dims are flattened.
    x, w, b = make_inputs((2, 19), 45, 70, dtype, activation)
    check_against_reference(x, w, b, activation, dtype)


@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
def test_linear_without_bias(activation):
    x, w, _ = make_inputs((37,), 45, 70, torch.bfloat16, activation, bias=False)
    check_against_reference(x, w, None, activation, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["silu", "swiglu"])
def test_transposed_and_noncontiguous_operands(dtype, activation):
    x, w, b = make_inputs((37,), 45, 70, dtype, activation)
    w_t = w.t().contiguous().t()  # same values, strides (1, rows): a transposed view
    x_wide = torch.zeros(37, 2 * 45, dtype=dtype, device=DEVICE)
    x_wide[:, ::2] = x
    x_strided = x_wide[:, ::2]  # column stride 2
    assert not w_t.is_contiguous() and not x_strided.is_contiguous()
    check_against_reference(x_strided, w_t, b, activation, dtype)


def test_broadcast_grad_output():
    # y.sum().backward() hands the backward an expanded gradient with all-zero strides.
    x, w, b = make_inputs((3, 11), 45, 70, torch.float32, "gelu")
    leaves = [t.requires_grad_() for t in (x, w, b)]
    kernels.linear(*leaves, activation="gelu").sum().backward()
    refs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    reference(*refs, "gelu").sum().backward()
    for leaf, ref in zip(leaves, refs):
        assert rel_err(leaf.grad, ref.grad) < TOL[torch.float32]


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_many_row_tiles(activation):
    # 300 rows = 10 row tiles of 32 (interpreter config): more than GROUP_SIZE_M = 8, so the grouped order has a
    # partial last group. K and N stay small to keep the interpreter fast.
    x, w, b = make_inputs((300,), 20, 40, torch.float16, activation)
    check_against_reference(x, w, b, activation, torch.float16)


@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
def test_gradcheck_fp64(activation):
    x, w, b = make_inputs((3,), 5, 4, torch.float64, activation)
    inputs = tuple(t.requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: kernels.linear(x, w, b, activation=activation), inputs)


@pytest.mark.parametrize("activation", [None, "gelu_tanh", "swiglu"])
def test_main_grad_accumulates_over_two_backward_passes(activation):
    dtype = torch.bfloat16
    x1, w, b = make_inputs((37,), 45, 70, dtype, activation, seed=0)
    x2, _, _ = make_inputs((37,), 45, 70, dtype, activation, seed=5)
    w.requires_grad_()
    b.requires_grad_()
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEVICE)
    expected = torch.zeros(w.shape, dtype=torch.float64, device=DEVICE)
    for seed, x in ((1, x1), (2, x2)):
        y = kernels.linear(x, w, b, activation=activation)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
        y.backward(gy)
        w_ref = w.detach().double().requires_grad_()
        reference(x.double(), w_ref, b.detach().double(), activation).backward(gy.double())
        expected += w_ref.grad
    assert w.grad is None, "no low-precision weight gradient may be materialised"
    assert w.main_grad.dtype == torch.float32
    assert rel_err(w.main_grad, expected) < TOL[dtype]
    assert b.grad is not None


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_dgrad_computes_dz_once_then_a_plain_gemm(activation):
    # dz = g·act'(z) is one elementwise pass; the dgrad GEMM then reads dz. Fusing act' into the GEMM's operand load
    # recomputed it for every output-column tile and kept the loop off the tensor-core pipeline: 0.13x torch's fc1
    # backward on an H200 (bench.kernels, bench/results/gpu).
    x, w, b = (t.requires_grad_() for t in make_inputs((37,), 45, 70, torch.float32, activation))
    before = triton_ops.LAUNCHES.copy()
    y = kernels.linear(x, w, b, activation=activation)
    y.backward(torch.randn_like(y))
    assert triton_ops.LAUNCHES["act_bwd"] == before["act_bwd"] + 1
    assert triton_ops.LAUNCHES["linear_dgrad"] == before["linear_dgrad"] + 1


@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
def test_weight_only_gradient_skips_dgrad(activation):
    # x without requires_grad (a first layer): dz comes from the elementwise kernel (or is grad_out itself).
    x, w, b = make_inputs((37,), 45, 70, torch.float32, activation)
    w.requires_grad_()
    before = triton_ops.LAUNCHES.copy()
    y = kernels.linear(x, w, b, activation=activation)
    gy = torch.randn_like(y)
    y.backward(gy)
    assert triton_ops.LAUNCHES["linear_dgrad"] == before["linear_dgrad"]
    assert triton_ops.LAUNCHES["act_bwd"] == before["act_bwd"] + (activation is not None)
    w_ref = w.detach().double().requires_grad_()
    reference(x.double(), w_ref, b.double(), activation).backward(gy.double())
    assert rel_err(w.grad, w_ref.grad) < TOL[torch.float32]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_primitives_match_torch_ops(activation):
    """The four primitives (what the TP layers call), including the saved pre-activation and dz, vs torch_ops."""
    x, w, b = make_inputs((37,), 45, 70, torch.float32, activation)
    y, z = kernels.linear_forward(x, w, b, activation)
    y_ref, z_ref = torch_ops.linear_forward(x, w, b, activation)
    assert z.shape == z_ref.shape == (37, w.shape[0])
    assert rel_err(y, y_ref) < 1e-5 and rel_err(z, z_ref) < 1e-5
    gy = torch.randn_like(y)
    dx, dz = kernels.linear_dgrad(gy, w, z, activation)
    dx_ref, dz_ref = torch_ops.linear_dgrad(gy, w, z_ref, activation)
    assert dz.shape == dz_ref.shape == z.shape
    assert rel_err(dx, dx_ref) < 1e-5 and rel_err(dz, dz_ref) < 1e-5
    dw = kernels.linear_wgrad(dz, x)
    assert rel_err(dw, torch_ops.linear_wgrad(dz_ref, x)) < 1e-5
    main_grad = torch.ones(w.shape, device=DEVICE)
    assert kernels.linear_wgrad(dz, x, main_grad=main_grad) is None
    assert rel_err(main_grad, 1 + dw) < 1e-5


def test_triton_path_ran():
    x, w, b = make_inputs((37,), 45, 70, torch.float32, "gelu")
    leaves = [t.requires_grad_() for t in (x, w, b)]
    before = triton_ops.LAUNCHES.copy()
    kernels.linear(*leaves, activation="gelu").sum().backward()
    kernels.swiglu_linear(x, torch.cat([w, w]))
    for name in ("linear_fwd", "linear_dgrad", "linear_wgrad", "swiglu_fwd"):
        assert triton_ops.LAUNCHES[name] == before[name] + 1, name
    with kernels.use_backend("torch"):
        before = triton_ops.LAUNCHES.copy()
        kernels.linear(x, w, b, activation="gelu").sum().backward()
        assert before == triton_ops.LAUNCHES


def test_backend_dispatch():
    x = torch.zeros(2, 2, device=DEVICE)
    # The Triton backend's entry is kernels.triton_hopper (its Hopper kernels, else triton_ops')
    assert kernels.get_backend() == "triton" and ops._impl(x) is triton_hopper
    with kernels.use_backend("auto"):
        # conftest sets TRITON_INTERPRET=1 when there is no CUDA, so auto picks Triton here either way ...
        assert ops._impl(x) is triton_hopper
        # ... except for dtypes the kernels do not cover.
        assert ops._impl(x.to(torch.int32)) is torch_ops
    with kernels.use_backend("torch"):
        assert ops._impl(x) is torch_ops
    assert kernels.get_backend() == "triton"  # restored after the block
    with pytest.raises(ValueError, match="unknown kernels backend 'cuda'"):
        kernels.use_backend("cuda")  # rejected at the call, not only on entering a with-block
    kernels.use_backend("torch")  # a plain call sets the backend from now on
    try:
        assert kernels.get_backend() == "torch" and ops._impl(x) is torch_ops
    finally:
        kernels.use_backend("triton")


def test_invalid_arguments():
    x, w, b = make_inputs((4,), 8, 6, torch.float32, None)
    with pytest.raises(ValueError):
        kernels.linear(x, w, activation="tanh")
    with pytest.raises(TypeError):
        kernels.linear_forward(x, w.double())
    with pytest.raises(ValueError):
        kernels.linear_forward(x, w[:5], activation="swiglu")  # odd row count cannot be split into gate/up
    with pytest.raises(ValueError):
        kernels.linear_wgrad(torch.randn(4, 6), x, main_grad=torch.zeros(6, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("triton_version,numpy_version,bad", [
    ("3.6.0", "2.4.6", True), ("3.5.1", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
    ("3.9.0+git1234", "2.5.0.dev0", False), ("3.6.0", "1.26.4", False)])
def test_interpreter_names_a_triton_numpy_pair_it_cannot_run(monkeypatch, triton_version, numpy_version, bad):
    """Triton < 3.7's interpreter raises deep inside every GEMM's K loop with NumPy >= 2.4: the launch says so first,
    naming both versions and the fix."""
    problem = configs.interpreter_numpy_problem(triton_version, numpy_version)
    assert (problem is not None) == bad
    if bad:
        assert f"Triton {triton_version}" in problem and f"NumPy {numpy_version}" in problem
        assert "pip install 'numpy<2.4'" in problem and "\n" not in problem
    if CUDA:
        return  # (compiled kernels: no interpreter to check)
    monkeypatch.setattr(configs.triton, "__version__", triton_version)
    monkeypatch.setattr(configs.numpy, "__version__", numpy_version)
    x, w, _ = make_inputs((4,), 8, 6, torch.float32, None)
    if bad:
        with pytest.raises(RuntimeError, match=r"numpy<2\.4"):
            triton_ops.linear_forward(x, w)
        with pytest.raises(RuntimeError, match=r"numpy<2\.4"):
            kernels.grouped_forward(x, w.unsqueeze(0), [4])


@pytest.mark.parametrize("tune, expected", [("", [0, 1, 2]), ("one", [0]), ("2", [2]), ("3", None)])
def test_tp_kernels_tune_pins_the_candidates(monkeypatch, tune, expected):
    """TP_KERNELS_TUNE: "one" keeps the first fitting config, an index that one candidate alone (to time each tile),
    one past the list is refused in one line. Fake CUDA operands, the capability stubbed to Hopper's."""
    import types

    import triton

    cands = [triton.Config({"BLOCK_M": m, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=2)
             for m in (64, 128, 32)]
    monkeypatch.setenv("TP_KERNELS_TUNE", tune)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    for cached in (configs._family, configs._max_shared):
        cached.cache_clear()
        monkeypatch.setattr(configs, cached.__name__, functools.cache(cached.__wrapped__))
    fake = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    prune = configs.pruner()
    if expected is None:
        with pytest.raises(ValueError, match=r"^TP_KERNELS_TUNE=3: this kernel has 3 candidates"):
            prune(cands, {"x": fake})
    else:
        assert prune(cands, {"x": fake}) == [cands[i] for i in expected]


def test_public_api():
    assert set(kernels.__all__) == {"linear", "swiglu_linear", "ACTIVATIONS", "use_backend", "get_backend",
                                    "linear_forward", "linear_dgrad", "linear_wgrad", "tune_linear", "grouped_linear",
                                    "grouped_forward", "grouped_dgrad", "grouped_wgrad", "FP8_RECIPES", "choices"}
    assert kernels.ACTIVATIONS == (None, "gelu", "gelu_tanh", "silu", "relu", "swiglu")


# ----------------------------------------------------------------------------------------------- GPU only

@requires_cuda
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_gpu_compiled_bf16_large(activation):
    # Large enough for the big autotune tiles, with ragged edges.
    x, w, b = make_inputs((2, 1000), 1032, 1500, torch.bfloat16, activation)
    check_against_reference(x, w, b, activation, torch.bfloat16)


@requires_cuda
def test_gpu_autotune_has_several_configs_and_main_grad_is_not_double_counted():
    from kernels.configs import matmul_configs

    assert len(matmul_configs()) > 1 and not triton_ops.INTERPRET
    dtype = torch.bfloat16
    # A shape no other test used, so this call autotunes the wgrad kernel (each trial runs the kernel once).
    dz = torch.randn(777, 513, device="cuda", dtype=dtype)
    x = torch.randn(777, 259, device="cuda", dtype=dtype)
    main_grad = torch.ones(513, 259, device="cuda")
    kernels.linear_wgrad(dz, x, main_grad=main_grad)
    expected = 1 + dz.double().t() @ x.double()
    assert rel_err(main_grad, expected) < 1e-3
    assert triton_ops._linear_wgrad_kernel.best_config is not None


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_linear_on_torch_backend(activation):
    # The same autograd Function on the torch primitives (what CPU runs without the interpreter), main_grad included.
    x, w, b = make_inputs((37,), 45, 70, torch.float32, activation)
    with kernels.use_backend("torch"):
        before = triton_ops.LAUNCHES.copy()
        w.requires_grad_()
        w.main_grad = torch.zeros(w.shape, device=DEVICE)
        y = kernels.linear(x, w, b, activation=activation)
        gy = torch.randn_like(y)
        y.backward(gy)
        assert before == triton_ops.LAUNCHES
    w_ref = w.detach().double().requires_grad_()
    reference(x.double(), w_ref, b.double(), activation).backward(gy.double())
    assert w.grad is None and rel_err(w.main_grad, w_ref.grad) < TOL[torch.float32]


def test_dispatch_without_interpreter(tmp_path):
    # A fresh process without TRITON_INTERPRET: auto must stay on torch for CPU tensors, a forced "triton" must fail
    # with a clear message rather than Triton's "0 active drivers".
    import os
    import subprocess
    import sys

    script = (
        "import torch, kernels\n"
        "from kernels import ops, torch_ops\n"
        "x = torch.randn(4, 8); w = torch.randn(6, 8)\n"
        "with kernels.use_backend('auto'):\n"
        "    assert ops._impl(x) is torch_ops\n"
        "    kernels.linear(x, w, activation='gelu')\n"
        "with kernels.use_backend('triton'):\n"
        "    try:\n"
        "        kernels.linear(x, w)\n"
        "    except RuntimeError as e:\n"
        "        assert 'TRITON_INTERPRET' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('forced triton on CPU without the interpreter did not raise')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TP_KERNELS_BACKEND")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_empty_dimensions(activation):
    # No tokens, or no input features: nothing to launch for empty outputs, zeros where a sum over nothing is asked.
    for tokens, K in ((0, 8), (5, 0)):
        x, w, b = make_inputs((tokens,), K, 6, torch.float32, activation)
        leaves = [t.requires_grad_() for t in (x, w, b)]
        y = kernels.linear(*leaves, activation=activation)
        y_ref = reference(*[t.detach() for t in leaves], activation)
        torch.testing.assert_close(y, y_ref)
        y.backward(torch.ones_like(y))
        assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape
        assert torch.count_nonzero(w.grad) == 0 and (tokens == 0) == (torch.count_nonzero(b.grad) == 0)


def test_autotune_buckets_the_token_count_and_a_linear_is_tuned_by_one_launch_of_each_kernel():
    """The autotune key holds the token count's power-of-two bucket (a new batch or generation length re-tunes only in
    a new bucket); kernels.tune_linear launches the forward, dgrad and wgrad once (none on the torch backend)."""
    import collections

    from kernels.triton_ops import LAUNCHES, token_bucket

    assert [token_bucket(m) for m in (1, 64, 65, 128, 129, 4096, 4097)] == [64, 64, 128, 128, 256, 4096, 8192]
    w, b = torch.randn(24, 16, device=DEVICE), torch.randn(24, device=DEVICE)
    with kernels.use_backend("torch"):
        assert not kernels.tune_linear(w, b, "gelu", tokens=37)
    with kernels.use_backend("triton"):
        before = collections.Counter(LAUNCHES)
        assert kernels.tune_linear(w, b, "gelu", tokens=37, main_grad=True)
        assert LAUNCHES - before == collections.Counter(linear_fwd=1, act_bwd=1, linear_dgrad=1, linear_wgrad=1)


def test_layers_tune_each_shape_once(monkeypatch):
    """tp.pipeline.runner.tune_kernels: every tensor-parallel linear's kernels, each distinct shape and flags once."""
    import tp
    from tp.pipeline.runner import tune_kernels

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    tp.init_mesh(backend="gloo")
    try:
        model = torch.nn.Sequential(tp.ColumnParallelLinear(8, 12, activation="gelu"), tp.RowParallelLinear(12, 8),
                                    tp.ColumnParallelLinear(8, 12, activation="gelu"), tp.ColumnParallelLinear(8, 12))
        calls = []
        monkeypatch.setattr(kernels, "tune_linear", lambda w, b, act, *, tokens, main_grad: calls.append(
            (tuple(w.shape), act, tokens, main_grad)) or True)
        assert tune_kernels(model, 6) == 3
        assert calls == [((12, 8), "gelu", 6, False), ((8, 12), None, 6, False), ((12, 8), None, 6, False)]
    finally:
        tp.destroy_mesh()


@pytest.mark.parametrize("grouped", [False, True])
def test_the_torch_wgrad_into_main_grad_multiplies_half_precision_operands_as_they_are(grouped):
    """The torch backend's wgrad into an fp32 main_grad upcast both bf16 operands and ran an fp32 GEMM: 10x cuBLAS's
    bf16 GEMM on an H200 (run 4: 21.5 ms against 2.2 for the Triton kernel at 8192 x 16384 x 4096, so "torch" lost
    every wgrad). cuBLAS multiplies bf16 and writes fp32 (`out_dtype`, accumulated in fp32 as the upcast GEMM
    is): no operand is copied. Checked on "meta", which has the CUDA op's signature (the CPU has no such kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kernels import grouped as grouped_ops

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    seen = []
    dz, x = (torch.empty(24, n, dtype=torch.bfloat16, device="meta") for n in (16, 8))
    main_grad = torch.empty((2, 16, 8) if grouped else (16, 8), device="meta")
    with Ops():
        if grouped:
            grouped_ops._torch_wgrad(dz, x, torch.tensor([10, 14]), main_grad)
        else:
            torch_ops.linear_wgrad(dz, x, main_grad=main_grad)
    assert not any("_to_copy" in op for op in seen) and "aten.mm.dtype" in seen, seen
    seen.clear()
    with Ops():  # operands of two dtypes: cuBLAS's out_dtype GEMM takes one, so both are upcast
        torch_ops.accumulate_mm(main_grad.flatten(0, -2)[:16], dz.t(), x.float())
    assert "aten.mm.dtype" not in seen and "aten.addmm_.default" in seen, seen


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_operands_no_backend_takes_get_the_same_line_on_every_backend(backend):
    """A bias of another shape, a 1-D weight, swiglu's odd row count and mixed dtypes: one line naming the value,
    the same on each backend (the Triton one named 3-D shapes the caller never passed, torch's took [1, N] biases
    and gave raw shape and dtype errors)."""
    x, weight = torch.randn(4, 8), torch.randn(6, 8)
    cases = [
        (dict(bias=torch.randn(1, 6)), ValueError, r"^bias must be \[out_features\] = \(6,\), got shape \(1, 6\)$"),
        (dict(weight=torch.randn(8)), ValueError, r"^weight must be 2-D \[out_features, in_features\], got shape "
                                                  r"\(8,\)$"),
        (dict(weight=torch.randn(7, 8), activation="swiglu"), ValueError,
         r"^activation='swiglu' needs an even number of weight rows \(gate, up\), got weight shape \(7, 8\)$"),
        (dict(x=x.bfloat16()), TypeError, r"^x is torch.bfloat16 but weight is torch.float32 \(outside autocast "
                                          r"the operands share one dtype\)$"),
    ]
    with kernels.use_backend(backend):
        for changes, error, message in cases:
            args = dict(x=x, weight=weight) | changes
            with pytest.raises(error, match=message):
                kernels.linear(args.pop("x"), args.pop("weight"), **args)
