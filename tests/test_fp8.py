"""FP8 linears (kernels.fp8): each GEMM equals the same quantization written in plain torch, stays within fp8's error
of the fp32 linear, keeps main_grad's fp32 accumulation; both recipes give the serial result at tp 2 with and without
sequence parallelism (docs/fp8.md's claim); a job with --fp8-recipe trains the serial fp8 curve at tp 2, near fp32's;
sizes torch._scaled_mm cannot take are one ValueError line at construction."""
import contextlib
import math
import os
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kernels
import tp
from kernels.fp8 import FP8_RECIPES, Fp8Scaling
from kernels.linear import KEPT_BY_PRODUCER
from kernels.triton_ops import LAUNCHES
from models import GPTConfig
from models.training.cli import parser
from tp.testing import distributed, run

from .helpers import train_refusal
from .test_train import SMALL, _losses, _train_on_ranks

RECIPES = tuple(FP8_RECIPES)


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRAD_DTYPE = {"tensorwise": E5M2, "rowwise": E4M3}  # dz's float8: torchao's recipes (Float8LinearConfig())


def _dequantized(t, recipe, dim, dtype=E4M3):
    """t through `dtype` (e4m3, or e5m2) and back as the recipe scales it: one scale per tensor, or (rowwise) one per
    slice along `dim` (the GEMM's contraction dim of t) rounded down to a power of two; the scale computed in fp32."""
    t, top = t.detach().float(), torch.finfo(dtype).max
    amax = t.abs().amax() if recipe == "tensorwise" else t.abs().amax(dim, keepdim=True)
    scale = top / amax.clamp(min=1e-12)
    if recipe == "rowwise":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t * scale).clamp(-top, top).to(dtype).double() / scale.double()


def _reference(x, w, b, dy, recipe, grad_dtype=None):
    """(y, dx, dW) of y = x·Wᵀ + b with every GEMM's operands quantized as the recipe says (x and W in e4m3, the
    output gradient dy in the recipe's gradient float8, or `grad_dtype`), multiplied in fp64."""
    grad_dtype = grad_dtype or GRAD_DTYPE[recipe]
    y = _dequantized(x, recipe, 1) @ _dequantized(w, recipe, 1).t() + b.double()
    dx = _dequantized(dy, recipe, 1, grad_dtype) @ _dequantized(w, recipe, 0)
    dw = _dequantized(dy.t(), recipe, 1, grad_dtype) @ _dequantized(x, recipe, 0)
    return y, dx, dw


def _inputs(dtype, tokens=24):  # 24 tokens: the wgrad's contraction dim is padded to 32 for torch._scaled_mm
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(tokens, 32, generator=g), torch.randn(48, 32, generator=g) / 4
    b, dy = torch.randn(48, generator=g), torch.randn(tokens, 48, generator=g)
    return [t.to(dtype).requires_grad_(i < 3) for i, t in enumerate((x, w, b, dy))]


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_gemm_is_the_recipes_quantization(recipe):
    x, w, b, dy = _inputs(torch.float32)
    y = kernels.linear(x, w, b, fp8_recipe=recipe)
    y.backward(dy)
    for ours, ref in zip((y, x.grad, w.grad), _reference(x, w, b, dy, recipe)):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, dy.sum(0))  # (the bias gradient is not a GEMM: unchanged)


def _through(t, dtype):
    """t (fp32) through `dtype` under its tensorwise scale, float8 max / amax(|t|), and back in fp64."""
    scale = torch.finfo(dtype).max / t.detach().abs().max()
    return (t.detach() * scale).to(dtype).double() / scale.double()


def test_tensorwise_casts_the_output_gradient_to_e5m2_as_torchao():
    """torchao's tensorwise recipe (a plain Float8LinearConfig()) and Transformer Engine's default HYBRID format cast
    x and W to e4m3 and the output gradient dz to e5m2 (max 57344: range over precision, for gradients). The dgrad
    dz·W and the wgrad dzᵀ·x equal dz written out by hand under 57344 / amax(|dz|), and differ from dz in e4m3."""
    x, w, b, dy = _inputs(torch.float32)
    kernels.linear(x, w, b, fp8_recipe="tensorwise").backward(dy)
    dz = _through(dy, torch.float8_e5m2)
    torch.testing.assert_close(x.grad.double(), dz @ _through(w, E4M3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), dz.t() @ _through(x, E4M3), rtol=1e-5, atol=1e-5)
    _, dx_e4m3, dw_e4m3 = _reference(x, w, b, dy, "tensorwise", grad_dtype=E4M3)
    assert not torch.allclose(x.grad.double(), dx_e4m3, rtol=1e-3, atol=1e-3)
    assert not torch.allclose(w.grad.double(), dw_e4m3, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_within_fp8_error_of_the_exact_linear(recipe, dtype):
    """e4m3 keeps 3 mantissa bits (a relative rounding of at most 1/16 per operand element)."""
    x, w, b, dy = _inputs(dtype)
    y = kernels.linear(x, w, b, activation="gelu", fp8_recipe=recipe)
    y.backward(dy)
    exact = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y_exact = F.gelu(F.linear(*exact))
    y_exact.backward(dy.double())
    for name, ours, ref in zip(("y", "dx", "dW", "db"), (y, x.grad, w.grad, b.grad),
                               (y_exact, *(t.grad for t in exact))):
        assert ours.dtype == dtype, name
        error = (ours.double() - ref).norm() / ref.norm()
        assert 0 < error < 0.08, f"{name}: relative error {error:.4f}"


def test_operands_reach_scaled_mm_in_the_layouts_cublaslt_takes(monkeypatch):
    """The CPU kernel takes any layout; cuBLASLt wants the left operand row-major, the right one column-major, the
    contraction dim and the right operand's columns multiples of 16, fp32 scales shaped [], or [M, 1] and [1, N]."""
    calls, scaled_mm = [], torch._scaled_mm

    def checked(a, b, *, scale_a, scale_b, out_dtype):
        calls.append((a.dtype, b.dtype))
        assert a.stride(1) == 1 and b.stride(0) == 1 and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert (scale_a.shape, scale_b.shape) in (((), ()), ((a.shape[0], 1), (1, b.shape[1])))
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    for recipe in RECIPES:
        x, w, b, dy = _inputs(torch.bfloat16, tokens=32)  # (no padding, which would copy dzᵀ row-major)
        kernels.linear(x, w, b, activation="swiglu", fp8_recipe=recipe).backward(dy[:, :24])
        # forward x·Wᵀ, dgrad dz·W, wgrad dzᵀ·x: dz (the left operand) in the recipe's gradient float8, never
        # e5m2 on both sides (cuBLASLt has no e5m2 x e5m2 GEMM)
        grad = GRAD_DTYPE[recipe]
        assert calls == [(E4M3, E4M3), (grad, E4M3), (grad, E4M3)], recipe
        calls.clear()


class _Traffic(TorchDispatchMode):
    """Bytes the aten ops read and write (their tensor arguments and outputs), torch._scaled_mm's and views' apart."""

    def __init__(self):
        super().__init__()
        self.scaling, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten._scaled_mm.default and not func.is_view:  # (a view moves nothing)
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.scaling += sum(t.numel() * t.element_size() for t in tensors)
            self.ops.append(func.__name__)
        return out



class _Collectives(TorchDispatchMode):
    """The all-reduces, and the dtypes the all-gathers (all_gather_into_tensor) send, in order. (A dispatch mode:
    CommDebugMode, a function mode too, hands autograd Functions other tensor objects than the caller's.)"""

    def __init__(self):
        super().__init__()
        self.all_reduces, self.gathered = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.all_reduces += func.overloadpacket is torch.ops.c10d.allreduce_
        if func.overloadpacket is torch.ops.c10d._allgather_base_:
            self.gathered.append(args[1].dtype)
        return func(*args, **(kwargs or {}))

@pytest.mark.parametrize("recipe", RECIPES)
def test_the_scaling_reads_each_operand_twice_and_writes_it_once(recipe):
    """Scaling an operand costs its amax (one read) and one fp32 product cast to e4m3 (a read, an fp32 write and
    read, an e4m3 write): 6.5 times its bf16 bytes, plus the scales. Written as torchao's recipe reads in eager
    (|t|, then amax; t in fp32, times the scale, clamped, cast) it moved 18 times them: the clamp cannot act
    (|t| <= amax and the scale is float8_max / amax, rounded down for rowwise), and amax(|t|) is one inf-norm pass."""
    x = torch.randn(256, 128, dtype=torch.bfloat16)
    w = torch.randn(192, 128, dtype=torch.bfloat16)
    with _Traffic() as traffic:
        kernels.fp8.scaled_matmul(x, w.t(), Fp8Scaling(recipe), contraction="in", out_dtype=torch.bfloat16)
    operands = (x.numel() + w.numel()) * 2
    assert traffic.scaling <= 7 * operands, (traffic.scaling / operands, traffic.ops)



def _casting_once(on: bool):
    """kernels.fp8.keeps_operands as it is (on) or answering False: every GEMM casting its own operands (the path
    rowwise takes), to compare the two."""
    return contextlib.nullcontext() if on else mock.patch.object(kernels.fp8, "keeps_operands", lambda fp8: False)


class _Amaxes(TorchDispatchMode):
    """The amax passes (inf-norms) over tensors of at least `numel` elements, and the saved tensors' dtypes."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.passes = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.passes += func.overloadpacket is torch.ops.aten.linalg_vector_norm and args[0].numel() >= self.numel
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_a_tensorwise_linear_casts_x_and_dz_once_and_saves_x_in_fp8(activation):
    """Tensorwise scales are per tensor, so the forward's cast of x is the wgrad's and the dgrad's cast of dz is the
    wgrad's: 4 amax passes instead of 6 (the weight's twice), and x is saved for backward as its e4m3 cast (one byte
    an element instead of two), unless x's producer keeps it anyway (a norm recomputed by DiscardedOutput): then x
    itself, cast again in the wgrad under the forward's scale. The results are bit for bit those of each GEMM
    casting its own operands."""
    results = {}
    for once, producer_keeps in ((True, False), (True, True), (False, False)):
        x, w, b, dy = _inputs(torch.bfloat16)
        dy = dy[:, :24] if activation else dy
        if producer_keeps:
            setattr(x, KEPT_BY_PRODUCER, True)
        saved = []
        with _casting_once(once), _Amaxes(min(x.numel(), dy.numel())) as amaxes, \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = kernels.linear(x, w, b, activation=activation, fp8_recipe="tensorwise")
            y.backward(dy)
        results[once, producer_keeps] = y, x.grad, w.grad, b.grad
        x_saved = [t for t in saved if t.shape == x.shape]
        assert amaxes.passes == (4 if once else 6)
        assert [t.dtype for t in x_saved] == [torch.float8_e4m3fn if once and not producer_keeps else torch.bfloat16]
        assert (producer_keeps or not once) == (x_saved[0].untyped_storage().data_ptr() ==
                                                x.untyped_storage().data_ptr())  # (x itself, not a copy)
    for kept in ((True, False), (True, True)):
        for got, want in zip(results[kept], results[False, False]):
            assert torch.equal(got, want), kept


@distributed(world_size=2)
def test_at_tp_2_the_kept_casts_save_an_all_reduce_per_linear_and_gather_x_in_fp8():
    """A column- and a row-parallel tensorwise linear at tp 2, with and without SP: the wgrad reuses the amaxes the
    forward and the dgrad reduced (one all-reduce fewer per linear), under SP the backward re-gathers x's e4m3 cast
    (half the bytes), and every output and gradient is bit for bit the per-GEMM casts'."""
    tp.init_mesh(tp=2)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(8, 3, 32, generator=g), torch.randn(8, 3, 32, generator=g)
    w1, w2, b2 = torch.randn(128, 32, generator=g) / 6, torch.randn(32, 64, generator=g) / 8, torch.randn(32)
    for sp, producer_keeps in ((False, False), (True, False), (True, True)):
        results, reduces, gathered = {}, {}, {}
        for once in (True, False):
            fc1, fc2 = _mlp("tensorwise", sp, w1, w2, b2)
            x_local = (x.chunk(2)[rank] if sp else x).clone().requires_grad_()
            if producer_keeps:  # (fc1 saves x itself and re-gathers it in fp32, as the per-GEMM path does)
                setattr(x_local, KEPT_BY_PRODUCER, True)
            with _casting_once(once), _Collectives() as collectives:
                y = fc2(fc1(x_local))
                y.backward(dy.chunk(2)[rank] if sp else dy)
            results[once] = y, x_local.grad, fc1.weight.grad, fc2.weight.grad, fc2.bias.grad
            reduces[once], gathered[once] = collectives.all_reduces, collectives.gathered
        for got, want in zip(results[True], results[False]):
            assert torch.equal(got, want), sp
        assert reduces[True] == reduces[False] - 2, (sp, reduces)
        if sp:  # fc1's input; in backward fc2's output gradient, then fc1's input again (its e4m3 bytes, kept)
            kept_gather = torch.float32 if producer_keeps else torch.uint8
            assert gathered == {True: [torch.float32, torch.float32, kept_gather], False: [torch.float32] * 3}

def test_the_weight_gradient_accumulates_into_main_grad_in_fp32():
    x, w, b, dy = _inputs(torch.bfloat16)
    w.main_grad = torch.zeros(w.shape)
    for _ in range(2):
        kernels.linear(x, w, fp8_recipe="rowwise").backward(dy)
    assert w.grad is None
    _, _, dw = _reference(x, w, b, dy, "rowwise")
    torch.testing.assert_close(w.main_grad.double(), 2 * dw, rtol=1e-5, atol=1e-5)


def test_sizes_scaled_mm_cannot_take_and_unknown_recipes_are_one_line():
    x = torch.randn(4, 24)
    with pytest.raises(ValueError, match=r"^fp8_recipe='tensorwise': the weight has in_features=24, out_features=48 "
                                         r".*multiples of 16$"):
        kernels.linear(x, torch.randn(48, 24), fp8_recipe="tensorwise")
    with pytest.raises(ValueError, match=r"unknown fp8_recipe 'e5m2'; expected one of \('tensorwise', 'rowwise'\)"):
        kernels.linear(x, torch.randn(48, 24), fp8_recipe="e5m2")
    for recipe in RECIPES:  # (fp64: torch._scaled_mm has no such output)
        with pytest.raises(ValueError, match=rf"^fp8_recipe='{recipe}' computes in fp32, bf16 or fp16, not "
                                             r"torch.float64$"):
            kernels.linear(torch.randn(4, 32, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64),
                           fp8_recipe=recipe)
        with pytest.raises(ValueError, match=rf"^fp8_recipe='{recipe}' computes in fp32, bf16 or fp16, not "
                                             r"torch.float64$"):
            kernels.grouped_linear(torch.randn(4, 32, dtype=torch.float64), torch.randn(2, 16, 32, dtype=torch.float64),
                                   [3, 1], fp8_recipe=recipe)
    config = dict(hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, fp8_recipe="tensorwise")
    GPTConfig(**config).check_tp(1)
    with pytest.raises(ValueError, match=r"the MLP's fc2 at tp=4 has in_features=24, out_features=64"):
        GPTConfig(**config).check_tp(4)
    GPTConfig(**config, num_experts=4, moe_ffn_hidden_size=32).check_experts(2, 2)  # (the experts: test_fp8_moe)


@pytest.mark.parametrize("flags,message", [
    (["--fp8-recipe", "rowwise", "--hidden-size", "72"], r"^error: fp8_recipe='rowwise': the QKV projection at tp=2 "
                                                          r"has in_features=72, out_features=72 \(per rank\); "),
    (["--fp8-recipe", "tensorwise", "--model", "tiny-moe", "--moe-ffn-hidden-size", "40"],
     r"^error: --ep=1 --etp=2: fp8_recipe='tensorwise': the experts' fc1 at etp=2 has in_features=64, out_features=40"),
    (["--fp8-recipe", "rowwise", "--model", "tiny-deepseek"], r"^error: .*latent attention has no fp8 path"),
])
def test_a_bad_fp8_job_is_one_line_before_any_process(flags, message, capsys):
    code, out, lines = train_refusal(flags, capsys)
    assert code == 2 and out == "" and len(lines) == 1 and re.search(message, lines[0]), lines


def test_an_unknown_recipe_is_the_parsers_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(["--fp8-recipe", "foo"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: argument --fp8-recipe: invalid choice: 'foo' (choose from 'tensorwise', 'rowwise')")


def _mlp(recipe, sequence_parallel, w1, w2, b2):
    fc1 = tp.ColumnParallelLinear(32, 128, bias=False, activation="swiglu", sequence_parallel=sequence_parallel,
                                  fp8_recipe=recipe)
    fc2 = tp.RowParallelLinear(64, 32, sequence_parallel=sequence_parallel, fp8_recipe=recipe)
    fc1.load_master(w1)
    fc2.load_master(w2, b2)
    return fc1, fc2


@distributed(world_size=2)
def test_every_recipe_gives_the_serial_result_at_tp_2_with_and_without_sp():
    """docs/fp8.md: the amaxes a tp split would change are all-reduced, so each rank's scales are the serial ones."""
    tp.init_mesh(tp=2)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(8, 3, 32, generator=g), torch.randn(8, 3, 32, generator=g)
    w1, w2, b2 = torch.randn(128, 32, generator=g) / 6, torch.randn(32, 64, generator=g) / 8, torch.randn(32)
    with pytest.raises(ValueError, match=r"RowParallelLinear\(48, 32\) at tp=2 has in_features=24, out_features=32"):
        tp.RowParallelLinear(48, 32, fp8_recipe="rowwise")
    for recipe in RECIPES:
        serial = [t.clone().requires_grad_() for t in (x, w1, w2, b2)]
        y = kernels.linear(kernels.swiglu_linear(serial[0], serial[1], fp8_recipe=recipe), serial[2], serial[3],
                           fp8_recipe=recipe)
        y.backward(dy)
        for sp in (False, True):
            fc1, fc2 = _mlp(recipe, sp, w1, w2, b2)
            chunk = (lambda t: t.chunk(2)[rank]) if sp else (lambda t: t)
            x_local = chunk(x).clone().requires_grad_()
            y_local = fc2(fc1(x_local))
            y_local.backward(chunk(dy))
            where = f"{recipe}, sequence_parallel={sp}"
            pairs = ((y_local, chunk(y)), (x_local.grad, chunk(serial[0].grad)),
                     (fc1.weight.grad, fc1.shard_dense(serial[1].grad)),
                     (fc2.weight.grad, fc2.shard_dense(serial[2].grad)), (fc2.bias.grad, serial[3].grad))
            for i, (ours, ref) in enumerate(pairs):
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}, #{i}: {m}")


@distributed(world_size=2)
def test_without_the_reduction_a_rank_would_scale_by_its_own_amax():
    """The reduction the previous test relies on matters: a shard's own amax gives another result."""
    tp.init_mesh(tp=2)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(16, 32, generator=g), torch.randn(64, 32, generator=g)
    shard = w.chunk(2)[dist.get_rank()]
    reduced, _ = kernels.linear_forward(x, shard, fp8=Fp8Scaling("tensorwise", tp.get_mesh().tp_group, "out"))
    own, _ = kernels.linear_forward(x, shard, fp8=Fp8Scaling("tensorwise"))
    serial, _ = kernels.linear_forward(x, w, fp8=Fp8Scaling("tensorwise"))
    torch.testing.assert_close(reduced, serial.chunk(2, 1)[dist.get_rank()], rtol=1e-6, atol=1e-6)
    assert (shard.abs().max() == w.abs().max()) == torch.equal(own, reduced)


def _curve(tmp_path, name, world_size, *flags):
    log = os.path.join(tmp_path, f"{name}.jsonl")
    run(_train_on_ranks, world_size, flags=list(flags), log=log, timeout=300)
    return _losses(log)


def assert_serial_fp8_curve(tmp_path, splits, *, model=(), recipe="tensorwise", tol=1e-4):
    """Each split's fp8 curve is the serial fp8 curve (tensorwise 1e-4: the row layer's all-reduce sums in another
    order than the serial GEMM, and a value moved across an e4m3 rounding boundary rounds the other way), near fp32's.
    `model`: flags every run adds (another --model)."""
    assert SMALL[SMALL.index("--steps") + 1] == "3"
    one = [*model, "--tp", "1", "--pp", "1", "--dp", "1"]
    fp32 = _curve(tmp_path, "fp32", 1, *one)
    serial = _curve(tmp_path, "serial", 1, *one, "--fp8-recipe", recipe)
    for name, (world_size, flags) in splits.items():
        curve = _curve(tmp_path, name, world_size, *model, *flags, "--fp8-recipe", recipe)
        for step, (ours, reference, exact) in enumerate(zip(curve, serial, fp32, strict=True)):
            assert abs(ours - reference) <= tol * reference, f"{name}, step {step + 1}: {ours} vs {reference}"
            assert abs(reference - exact) <= 0.02 * exact, f"step {step + 1}: fp8 {reference} vs fp32 {exact}"


def test_an_fp8_job_trains_the_serial_fp8_curve_at_tp_2_with_sp_and_at_pp_2_zero_bubble(tmp_path):
    """(zb: the weight gradients deferred with the e4m3 casts of x and dz the linears kept)"""
    assert_serial_fp8_curve(tmp_path, {"tp2_sp": (2, ["--tp", "2", "--pp", "1", "--dp", "1", "--sequence-parallel"]),
                                       "pp2_zb": (2, ["--tp", "1", "--pp", "2", "--dp", "1", "--schedule", "zb"])})


@pytest.mark.slow
def test_an_fp8_job_trains_the_serial_fp8_curve_at_tp_2_pp_2_dp_2(tmp_path):
    assert_serial_fp8_curve(tmp_path, {"tp2": (2, ["--tp", "2", "--pp", "1", "--dp", "1"]),
                                        "2x2x2": (8, ["--tp", "2", "--pp", "2", "--dp", "2"])})


def _check_the_fused_cast(dtype):
    """kernels.fp8_cast's cast to `dtype` against torch's on the CPU: every finite value of dtype, the midpoints
    between neighbours (ties to even) and their fp32 neighbours, subnormals, ±0, ±max and max plus an fp32 rounding,
    random values over dtype's range; per-row and per-column scales, both layouts."""
    from kernels import fp8_cast

    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
    top, tiny = torch.finfo(dtype).max, torch.finfo(dtype).smallest_normal
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique()
    midpoints = (values[1:] + values[:-1]) / 2
    edges = [torch.nextafter(midpoints, torch.tensor(direction)) for direction in (1e9, -1e9)]
    exponents = torch.randint(int(math.log2(tiny)) - 6, math.ceil(math.log2(top)), (4000,),
                              generator=torch.Generator().manual_seed(1))
    randoms = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * torch.exp2(exponents.float())
    above = torch.nextafter(torch.tensor([top]), torch.tensor(math.inf))  # (an fp32 rounding over the max)
    t = torch.cat([values, midpoints, *edges, randoms.clamp(-top, top), torch.tensor([0.0, -0.0]), above, -above])
    t = t[: t.numel() // 64 * 64].reshape(64, -1)
    want = t.clamp(-top, top).to(dtype)
    for scale in (torch.tensor(1.0), torch.exp2(torch.arange(64.0) % 3 - 1)[:, None],
                  torch.exp2(torch.arange(t.shape[1]) % 2 - 1.0)[None, :]):  # (powers of 2: t / scale · scale is t)
        for column_major in (False, True):
            got = fp8_cast.cast_to_float8((t / scale).to(device), scale.to(device), dtype, column_major=column_major)
            assert got.dtype == dtype and got.is_contiguous() != column_major
            assert torch.equal(got.view(torch.uint8).cpu(), want.view(torch.uint8))


def test_the_fused_cast_writes_torchs_e4m3_bits():
    """kernels.fp8_cast's one-pass cast (integer rounding on the fp32 bits, the same code on the GPU and under the
    interpreter) against torch's cast on the CPU (_check_the_fused_cast). On a GPU (TP_TEST_DEVICE=cuda:
    bench.gpu_check's kernels section) the kernel runs compiled."""
    _check_the_fused_cast(E4M3)
    from kernels import fp8_cast

    t, scale = torch.randn(64, 32), torch.tensor(2.0)
    assert torch.equal(fp8_cast.cast_to_e4m3(t, scale).view(torch.uint8),  # (the e4m3 name, kept)
                       fp8_cast.cast_to_float8(t, scale, E4M3).view(torch.uint8))


def test_the_fused_cast_writes_torchs_e5m2_bits():
    """The same for e5m2 (tensorwise's output gradients): 2 mantissa bits, exponent bias 15, max 57344, subnormals
    down to 2^-16."""
    _check_the_fused_cast(E5M2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_triton_backend_casts_in_one_pass_to_the_same_result(recipe):
    """Under a Triton backend (here interpreted) the fp8 linear's casts are kernels.fp8_cast's: forward and both
    gradients bit for bit the torch backend's."""
    results = {}
    for backend in ("torch", "triton"):
        x, w, b, dy = _inputs(torch.bfloat16)
        before = LAUNCHES["fp8_cast"]
        with kernels.use_backend(backend):
            y = kernels.linear(x, w, b, fp8_recipe=recipe)
            y.backward(dy)
        launches = LAUNCHES["fp8_cast"] - before
        # two operands in each of the three GEMMs; tensorwise casts x and dz once for two GEMMs each
        assert launches == ({"tensorwise": 4, "rowwise": 6}[recipe] if backend == "triton" else 0)
        results[backend] = (y, x.grad, w.grad)
    for got, want in zip(results["triton"], results["torch"]):
        assert torch.equal(got, want)
