"""The fused kernels of issue 37 (RMSNorm with the residual add, RoPE, the vocab-parallel loss chunked over tokens)
against the torch code they replace: the kernels under the interpreter (compiled on a GPU) in fp32 and fp64, forward
and backward; the default backend keeps torch on CPU; and the model at tp 2 with sequence parallelism equals itself
with the fused path, forward and every gradient."""
import pytest
import torch
import torch.nn.functional as F

import kernels
import models
import tp
from kernels import triton_ops
from kernels.configs import INTERPRET
from tp.testing import distributed

from .helpers import assert_close, randn

# The tests' tensors are on the CPU: the kernels run there under the interpreter only (conftest sets it unless the
# suite's tensors are on a GPU, TP_TEST_DEVICE=cuda: bench.gpu_check's mfu section runs the compiled kernels there).
pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1 for the Triton kernels")


def _torch_rms_norm(x, weight, eps, residual=None):
    """models.Norm's torch code (Hugging Face's RMSNorm) after the residual add."""
    total = x if residual is None else residual + x
    return weight * F.rms_norm(total.float(), total.shape[-1:], eps=eps).to(total.dtype), total


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-5), (torch.bfloat16, 0.07)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_torch_forward_and_backward(dtype, atol, with_residual):
    """Statistics in fp32 for every dtype, as Hugging Face's (fp64 too: the torch code's rounding, hence 1e-5); a
    hidden size off the power of two (masks) and more rows than one program takes; both outputs' gradients."""
    from kernels import rms_norm

    x, residual = (randn(9, 2, 40, seed=s, dtype=dtype, requires_grad=True) for s in (0, 1))
    weight = (randn(40, seed=2, dtype=dtype) + 1).requires_grad_()
    residual = residual if with_residual else None
    grad_out, grad_sum = randn(9, 2, 40, seed=3, dtype=dtype), randn(9, 2, 40, seed=4, dtype=dtype)
    results = []
    for fn in (lambda: rms_norm.rms_norm(x, weight, 1e-5, residual=residual), lambda: _torch_rms_norm(
            x, weight, 1e-5, residual)):
        out, total = fn()
        leaves = [t for t in (x, weight, residual) if t is not None]
        grads = torch.autograd.grad((out, total) if with_residual else (out,),
                                    leaves, (grad_out, grad_sum) if with_residual else (grad_out,))
        results.append((out, total, *grads))
    for name, fused, expected in zip(("out", "residual", "dx", "dweight", "dresidual"), *results):
        assert fused.dtype == expected.dtype, name
        assert_close(fused, expected, atol * (4 if name == "dweight" else 1), name)  # (dweight: a sum of 18 rows)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.float64, 1e-14)])
def test_rope_kernel_matches_torch_in_every_layout(dtype, atol):
    """models.rotary with the kernel (forced "triton") vs torch: full rotation from the tables, per-token positions
    (documents), a context-parallel shard's positions, a partial rotation (GLM's half) and interleaved pairs
    (DeepSeek's); q and k heads of a non-contiguous [b, n, s, d] view; forward and the input's gradient."""
    from types import SimpleNamespace

    from models.rope import rotary

    base = randn(6, 2, 5 * 12, seed=0, dtype=dtype).view(6, 2, 5, 12).permute(1, 2, 0, 3)  # [b, n, s, d] view
    grad = randn(2, 5, 6, 12, seed=1, dtype=dtype)
    layouts = [(dict(), None), (dict(), torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])),
               (dict(), (torch.tensor([2, 3, 8, 9, 10, 11]), 12)), (dict(rotary_percent=0.5), None),
               (dict(rope_interleave=True, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 8}), None)]
    for options, positions in layouts:
        config = SimpleNamespace(**{"rotary_percent": 1.0, "rope_interleave": False, "rope_theta": 100.0,
                                    "rope_scaling": None, **options})
        results, before = [], triton_ops.LAUNCHES["rope"]
        for backend in ("triton", "torch"):
            x = base.detach().requires_grad_()
            with kernels.use_backend(backend):
                out = rotary(x, config, positions)
                results.append((out, *torch.autograd.grad(out, x, grad)))
        assert triton_ops.LAUNCHES["rope"] == before + 2, options  # forward and backward
        for fused, expected in zip(*results):
            assert_close(fused, expected, atol, f"{options} {positions is not None}")


def test_fused_kernels_run_only_where_chosen():
    """The default ("auto") keeps torch for CPU tensors (the suite's numbers), "triton" runs the kernels."""
    norm, x = models.norm.Norm("rmsnorm", 24, 1e-6), randn(3, 24, seed=0, dtype=torch.float32)
    before = triton_ops.LAUNCHES["rms_norm_forward"]
    with kernels.use_backend("auto"):
        assert not kernels.ops.fused_kernels(x.device) and kernels.ops.fused_kernels(torch.device("cuda"))
        plain = norm(x)
    with kernels.use_backend("torch"):
        assert not kernels.ops.fused_kernels(torch.device("cuda"))
    assert triton_ops.LAUNCHES["rms_norm_forward"] == before
    with kernels.use_backend("triton"):
        assert kernels.ops.fused_kernels(x.device)
        fused, total = norm.add_forward(x, torch.zeros_like(x))
    assert triton_ops.LAUNCHES["rms_norm_forward"] == before + 1
    assert_close(fused, plain, 1e-6) and torch.equal(total, x)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@distributed(world_size=2)
def test_vocab_parallel_loss_kernels_match_torch_at_tp2(dtype, atol):
    """Padding columns (vocab 37 of 2 x 20, rank 1 holding 17 real ones), an ignored token, label smoothing, a
    masked row (all -inf but one column), fp64 exact: the loss and the logits' gradient of both paths."""
    mesh = tp.init_mesh(tp=2)
    logits = randn(7, 40, seed=0, dtype=dtype)
    logits[0] = -torch.inf
    logits[0, 5] = 2.0
    targets = torch.randint(0, 37, (7,), generator=torch.Generator().manual_seed(1))
    targets[0], targets[3] = 5, -100
    shard = logits.chunk(2, -1)[mesh.tp_rank]
    for smoothing in (0.0, 0.1):
        results, before = [], triton_ops.LAUNCHES["vocab_grad"]
        for backend in ("triton", "torch"):
            x = shard.clone().requires_grad_()
            with kernels.use_backend(backend):
                loss = tp.vocab_parallel_cross_entropy(x, targets, label_smoothing=smoothing, vocab_size=37,
                                                       reduction="none")
                (loss * torch.arange(7, dtype=dtype)).sum().backward()
            results.append((loss, x.grad))
        assert triton_ops.LAUNCHES["vocab_grad"] == before + 1
        if smoothing:  # the masked row's -inf logits: an infinite smoothed loss on both paths
            assert results[0][0][0] == results[1][0][0] == torch.inf
        assert_close(results[0][0][bool(smoothing):], results[1][0][bool(smoothing):], atol, f"loss {smoothing}")
        assert_close(results[0][1], results[1][1], atol, f"grad, smoothing {smoothing}")
        if mesh.tp_rank == 1:
            assert not results[0][1][:, 17:].any()  # padding columns


@distributed(world_size=2)
def test_gpt_with_the_fused_path_equals_the_torch_path_at_tp2_with_sp():
    """The whole model (RMSNorm with the residual add fused, RoPE, the loss's kernels, and, on "triton", the matmul
    kernels) at tp 2 with sequence parallelism: the loss and every gradient equal the torch backend's."""
    tp.init_mesh(tp=2)
    config = models.GPTConfig(vocab_size=50, hidden_size=16, num_heads=4, num_kv_heads=2, ffn_hidden_size=24,
                              num_layers=2, sequence_parallel=True, activation="swiglu")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 50, (2, 8), generator=g), torch.randint(0, 50, (2, 8), generator=g)
    results, before = [], dict(triton_ops.LAUNCHES)
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        model = models.GPT(config)
        with kernels.use_backend(backend):
            loss = model(x, y)
            loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    for name in ("rms_norm_forward", "rms_norm_backward", "rope", "vocab_stats", "vocab_grad"):
        assert triton_ops.LAUNCHES[name] > before.get(name, 0), name
    assert_close(results[0][0], results[1][0], 1e-5, "loss")
    for name, grad in results[1][1].items():
        assert_close(results[0][1][name], grad, 1e-5, name)


def test_fused_kernels_compile_as_one_op_each_without_breaks():
    """torch.compile (fullgraph) of RMSNorm with the residual add and RoPE on the fused path: each a custom op, the
    compiled loss and gradient those of eager."""
    from models.rope import rope

    norm = models.norm.Norm("rmsnorm", 32, 1e-6)

    def loss(x, residual, q):
        normed, total = norm.add_forward(x, residual)
        return normed.sum() + total.pow(2).sum() + rope(q, 100.0).pow(2).sum()

    x, residual = randn(4, 32, seed=0, dtype=torch.float32, requires_grad=True), randn(4, 32, seed=1,
                                                                                        dtype=torch.float32)
    q = randn(1, 2, 4, 8, seed=2, dtype=torch.float32, requires_grad=True)
    with kernels.use_backend("triton"):
        eager = loss(x, residual, q)
        grads = torch.autograd.grad(eager, (x, q))
        before = dict(triton_ops.LAUNCHES)
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(x, residual, q)
        compiled_grads = torch.autograd.grad(compiled, (x, q))
    assert triton_ops.LAUNCHES["rope"] > before["rope"] and triton_ops.LAUNCHES["rms_norm_backward"] > \
        before["rms_norm_backward"]
    assert_close(compiled, eager, 1e-5, "loss")
    for got, want in zip(compiled_grads, grads):
        assert_close(got, want, 1e-6, "grad")


_AOT = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import cross_entropy, rms_norm, rope

def compile(fn, types, constexprs, warps):
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        signature[name] = "constexpr" if name in constexprs else types[name]
        if signature[name].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps}).metadata.shared

shared = {}
for t, fp64 in (("bf16", False), ("fp32", False), ("fp64", True)):
    p, acc, i32 = "*" + t, "*fp64" if fp64 else "*fp32", "i32"
    for hidden in (2048, 8192):
        rows = max(1, 4096 // hidden)
        flags = dict(FP64=fp64, ROWS=rows, BLOCK=hidden)
        shared[f"rms_norm_forward {t} {hidden}"] = compile(rms_norm._rms_norm_forward_kernel, dict(
            x_ptr=p, residual_ptr=p, weight_ptr=p, out_ptr=p, sum_ptr=p, rstd_ptr="*fp32", rows=i32, H=i32,
            eps="fp32"), dict(HAS_RESIDUAL=True, **flags), rms_norm.warps(rows * hidden))
        shared[f"rms_norm_backward {t} {hidden}"] = compile(rms_norm._rms_norm_backward_kernel, dict(
            grad_ptr=p, grad_sum_ptr=p, sum_ptr=p, weight_ptr=p, rstd_ptr="*fp32", dx_ptr=p, dweight_ptr=acc,
            rows=i32, H=i32), dict(HAS_GRAD_SUM=True, **flags), rms_norm.warps(rows * hidden))
    shared[f"rope {t}"] = compile(rope._rope_kernel, dict(x_ptr=p, cos_ptr=p, sin_ptr=p, out_ptr=p, **dict.fromkeys(
        ("N", "S", "HALF", "stride_xb", "stride_xn", "stride_xs", "stride_cb", "stride_cs"), i32)),
        dict(SIGN=1.0, FP64=fp64, BLOCK_S=32, BLOCK_D=64), 4)
    shared[f"vocab_stats {t}"] = compile(cross_entropy._vocab_stats_kernel, dict(
        logits_ptr=p, targets_ptr="*i64", stats_ptr=acc, tokens=i32, real=i32, stride=i32),
        dict(SMOOTHING=True, FP64=fp64, BLOCK=4096), 8)
    shared[f"vocab_grad {t}"] = compile(cross_entropy._vocab_grad_kernel, dict(
        logits_ptr=p, targets_ptr="*i64", log_z_ptr=acc, grad_loss_ptr=acc, out_ptr=p, smoothing_ptr=acc, real=i32,
        stride=i32), dict(FP64=fp64, BLOCK=4096), 8)
print(json.dumps(shared))
'''


@pytest.mark.slow
def test_fused_kernels_compile_for_hopper_without_a_gpu():
    """Every fused kernel lowered to an sm_90 cubin (Triton's bundled ptxas, no GPU, the interpreter off) in bf16,
    fp32 and fp64 at the 1B shape's widths, within the shared memory of one block (tests/test_kernels_compile.py's
    way, for these kernels)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": root, "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    shared = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(shared) == 21 and max(shared.values()) <= 232448, shared
