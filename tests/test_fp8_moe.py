"""FP8 experts (kernels.grouped_fp8): the grouped GEMM in fp8 is each expert's fp8 linear (per-expert scales), its
wgrad accumulates into the fp32 main_grad; the MoE layer in fp8 at ep 2, tp 2 (SP) x ep 2 x etp 1 and etp 2 equals
the serial fp8 layer on the same tokens, output and every gradient (docs/fp8.md's claim), and without the amax
reduction over etp it would not; sizes torch._scaled_mm cannot take are one ValueError line."""
import contextlib

import pytest
import torch
import torch.distributed as dist

import kernels
import tp
from kernels.fp8 import FP8_RECIPES, Fp8Scaling
from kernels.linear import KEPT_BY_PRODUCER
from kernels.triton_ops import LAUNCHES
from models import GPTConfig
from tp.testing import distributed

from .helpers import assert_close, randn
from .moe_reference import MARGIN, dense_weights, reference_moe, routing_margin
from .test_fp8 import GRAD_DTYPE, _Amaxes, _casting_once, _Collectives, assert_serial_fp8_curve

RECIPES = tuple(FP8_RECIPES)
H, F, E, TOPK = 32, 32, 4, 2  # every local weight dim a multiple of 16 at etp 2
R, B = 8, 2  # rows of a micro-batch (split over tp under SP), batch


def _fp8_ffn(recipe):
    """One expert as fp8 linears (kernels.linear, one scale set per call): what the serial grouped GEMM must equal."""
    def ffn(x, fc1, fc2, activation):
        return kernels.linear(kernels.linear(x, fc1, activation=activation, fp8_recipe=recipe), fc2,
                              fp8_recipe=recipe)
    return ffn


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_grouped_gemm_is_each_experts_fp8_linear(recipe):
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 19, 8]  # an expert without rows; token counts not multiples of 16 (the wgrad pads them)
    x = torch.randn(sum(counts), H, generator=g, requires_grad=True)
    w1 = (torch.randn(E, 2 * F, H, generator=g) / 4).requires_grad_()
    w2 = (torch.randn(E, H, F, generator=g) / 4).requires_grad_()
    dy = torch.randn(sum(counts), H, generator=g)
    y = kernels.grouped_linear(kernels.grouped_linear(x, w1, counts, activation="swiglu", fp8_recipe=recipe), w2,
                               counts, fp8_recipe=recipe)
    y.backward(dy)
    ours = (y, x.grad, w1.grad, w2.grad)
    ref = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    rows = list(zip(ref[0].split(counts), dy.split(counts)))
    out = torch.cat([_fp8_ffn(recipe)(x_e, ref[1][e], ref[2][e], "swiglu") for e, (x_e, _) in enumerate(rows)])
    out.backward(dy)
    for i, (a, b) in enumerate(zip(ours, (out, ref[0].grad, ref[1].grad, ref[2].grad))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"#{i}: {m}")
    exact = kernels.grouped_linear(kernels.grouped_linear(x, w1, counts, activation="swiglu"), w2, counts)
    assert ((y - exact).norm() / exact.norm()).item() < 0.1  # (fp8's error: e4m3 keeps 3 mantissa bits)


@pytest.mark.parametrize("once", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_experts_take_dz_in_the_recipes_gradient_float8(recipe, once, monkeypatch):
    """As the linears (tests/test_fp8.py): each expert's forward multiplies e4m3 by e4m3, its dgrad and wgrad dz (the
    left operand) in e5m2 under tensorwise (torchao's Float8LinearConfig()), in e4m3 under rowwise; the same whether
    the wgrad takes the casts the forward and dgrad kept or casts its own operands."""
    calls, scaled_mm = [], torch._scaled_mm

    def recorded(a, b, **kwargs):
        calls.append((a.dtype, b.dtype))
        return scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recorded)
    counts = [5, 0, 19, 8]  # (3 experts with rows: 3 GEMMs per primitive)
    x = torch.randn(sum(counts), H, requires_grad=True)
    w = (torch.randn(E, F, H) / 4).requires_grad_()
    with _casting_once(once):
        kernels.grouped_linear(x, w, counts, fp8_recipe=recipe).backward(torch.randn(sum(counts), F))
    e4m3, grad = torch.float8_e4m3fn, GRAD_DTYPE[recipe]
    assert calls == [(e4m3, e4m3)] * 3 + [(grad, e4m3)] * 6


@pytest.mark.parametrize("recipe", RECIPES)
def test_under_a_triton_backend_the_experts_cast_in_one_pass_to_the_same_result(recipe):
    """The fused cast (kernels.fp8_cast, interpreted here) in the experts' fp8 GEMMs: bit for bit the torch
    backend's output and gradients, two casts per non-empty expert in each of the three GEMMs of both layers (rowwise)
    or in the forward and dgrad (tensorwise: the wgrad takes theirs)."""
    counts = [5, 0, 19, 8]
    results = {}
    for backend in ("torch", "triton"):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(sum(counts), H, generator=g, requires_grad=True)
        w1 = (torch.randn(E, 2 * F, H, generator=g) / 4).requires_grad_()
        w2 = (torch.randn(E, H, F, generator=g) / 4).requires_grad_()
        before = LAUNCHES["fp8_cast"]
        with kernels.use_backend(backend):
            y = kernels.grouped_linear(kernels.grouped_linear(x, w1, counts, activation="swiglu",
                                                              fp8_recipe=recipe), w2, counts, fp8_recipe=recipe)
            y.backward(torch.randn(y.shape, generator=g))
        casts = LAUNCHES["fp8_cast"] - before
        gemms = 3 if recipe == "rowwise" else 2
        assert casts == (2 * gemms * 2 * 3 if backend == "triton" else 0)  # 2 operands, the GEMMs, 2 layers, 3 experts
        results[backend] = (y, x.grad, w1.grad, w2.grad)
    for got, want in zip(results["triton"], results["torch"]):
        assert torch.equal(got, want)


def _two_layers(counts, deferred=None, x_grad=True, producer_keeps=False):
    """x, w1, w2 (parameters: a deferred wgrad needs their accumulators) and the grouped SwiGLU FFN's output in
    tensorwise fp8 through tp.moe.experts' grouped GEMM (kernels.grouped_linear's Function without deferral)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), H, generator=g, dtype=torch.bfloat16, requires_grad=x_grad)
    w1 = torch.nn.Parameter(torch.randn(E, 2 * F, H, generator=g, dtype=torch.bfloat16) / 4)
    w2 = torch.nn.Parameter(torch.randn(E, H, F, generator=g, dtype=torch.bfloat16) / 4)
    if producer_keeps:  # (as tp.recompute's DiscardedOutput marks what it refills in backward)
        setattr(x, KEPT_BY_PRODUCER, True)
    fp8 = Fp8Scaling("tensorwise")
    if deferred is None:
        grouped = kernels.grouped_linear
        y = grouped(grouped(x, w1, counts, activation="swiglu", fp8_recipe="tensorwise"), w2, counts,
                    fp8_recipe="tensorwise")
    else:
        grouped = tp.moe.experts.grouped_linear
        y = grouped(grouped(x, w1, counts, activation="swiglu", fp8=fp8), w2, counts, fp8=fp8)
    return x, w1, w2, y


@pytest.mark.parametrize("deferred, x_grad, producer_keeps", [(False, True, False), (True, True, False),
                                                                (False, False, False), (False, True, True),
                                                                (True, True, True)])
def test_tensorwise_experts_cast_x_and_dz_once_and_save_x_in_fp8(deferred, x_grad, producer_keeps):
    """As the dense tensorwise linear (tests/test_fp8.py): each expert's x and dz cast once for the GEMMs that read
    them, per-expert scales: two amax passes fewer per non-empty expert and layer (one in a layer without an input
    gradient: its wgrad casts dz), the layers' inputs saved for backward as e4m3 (x itself when its producer keeps
    it anyway: `--recompute-modules moe_act` refills fc2's input; cast again in the wgrad under the forward's
    scales), and bit for bit each GEMM casting its own operands, a zero-bubble W (deferred wgrads) too."""
    counts = [5, 0, 19, 8]
    results, passes = {}, {}
    for once in (True, False):
        saved = []
        with _casting_once(once), _Amaxes(1) as amaxes, \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with tp.pipeline.defer_wgrad() if deferred else contextlib.nullcontext() as wgrads:
                x, w1, w2, y = _two_layers(counts, deferred, x_grad, producer_keeps)
                y.backward(torch.ones_like(y))
            if deferred:
                assert w1.grad is None and len(wgrads) == 2
                wgrads.run()
        results[once], passes[once] = (y, x.grad, w1.grad, w2.grad), amaxes.passes
        inputs = [t for t in saved if t.shape in ((sum(counts), H), (sum(counts), F))]  # fc1's x, fc2's
        e4m3 = torch.float8_e4m3fn if once else torch.bfloat16
        assert [t.dtype for t in inputs] == [torch.bfloat16 if producer_keeps else e4m3, e4m3]
        assert (producer_keeps or not once) == (inputs[0].untyped_storage().data_ptr() ==
                                                x.untyped_storage().data_ptr())  # (x itself, not a copy)
    assert passes[True] == passes[False] - 3 * (2 + 2 if x_grad else 2 + 1)  # (3 experts with rows; fc2, fc1)
    for got, want in zip(results[True], results[False]):
        assert got is want is None or torch.equal(got, want)


@distributed(world_size=2)
def test_at_etp_2_the_tensorwise_experts_reuse_the_reduced_amaxes_in_the_wgrad():
    """At tp 2 (SP) with etp 2 the experts' wgrads reuse the amaxes the forward and dgrad all-reduced over etp: one
    all-reduce fewer per grouped GEMM, the same bits."""
    tp.init_mesh(tp=2)
    results, reduces = {}, {}
    for once in (True, False):
        torch.manual_seed(0)
        moe = tp.moe.MoE(H, F, E, TOPK, sequence_parallel=True, fp8_recipe="tensorwise")
        x = randn(R // 2, B, H, seed=3 + dist.get_rank(), dtype=torch.float32, requires_grad=True)
        with _casting_once(once), _Collectives() as collectives:
            y = moe(x)
            y.backward(torch.ones_like(y))
        results[once] = y, x.grad, moe.experts.fc1.grad, moe.experts.fc2.grad
        reduces[once] = collectives.all_reduces
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)
    assert reduces[True] == reduces[False] - 2, reduces


def test_the_fp8_wgrad_accumulates_into_main_grad():
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([7, 9])
    x, dz = torch.randn(16, H, generator=g), torch.randn(16, F, generator=g)
    fp8 = Fp8Scaling("rowwise")
    main_grad = torch.ones(2, F, H)
    assert kernels.grouped_wgrad(dz, x, counts, main_grad=main_grad, fp8=fp8) is None
    torch.testing.assert_close(main_grad, 1 + kernels.grouped_wgrad(dz.float(), x, counts, fp8=fp8))
    assert main_grad.dtype == torch.float32


def test_sizes_scaled_mm_cannot_take_are_one_line():
    with pytest.raises(ValueError, match=r"^fp8_recipe='tensorwise': the experts' fc2 at etp=2 has in_features=8, "
                                         r"out_features=32 \(per rank\); .* multiples of 16$"):
        tp.moe.GroupedExperts(4, 32, 16, etp_size=2, fp8_recipe="tensorwise")
    with pytest.raises(ValueError, match=r"^fp8_recipe='rowwise': the grouped weight has in_features=24"):
        kernels.grouped_linear(torch.randn(4, 24), torch.randn(2, 32, 24), [2, 2], fp8_recipe="rowwise")
    config = GPTConfig(hidden_size=64, num_heads=4, ffn_hidden_size=128, num_experts=4, moe_ffn_hidden_size=48,
                       fp8_recipe="rowwise")
    config.check_experts(1, 1)
    with pytest.raises(ValueError, match=r"the experts' fc2 at etp=2 has in_features=24, out_features=64"):
        config.check_experts(1, 2)
    with pytest.raises(ValueError, match=r"latent attention has no fp8 path"):
        GPTConfig(multi_latent_attention=True, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                  v_head_dim=16, fp8_recipe="rowwise")


def _serial_fp8_moe(moe, mesh, recipe, sp, seed):
    """This rank's (output, input grad) of the parallel layer and the serial fp8 reference on every token the
    ranks hold together, and the parallel layer's dense weight gradients against the reference's."""
    X, G = (randn(mesh.dp_size, R, B, H, seed=s, dtype=torch.float32) for s in (seed, seed + 1))
    mine = (lambda t: t[mesh.dp_rank].chunk(mesh.tp_size, 0)[mesh.tp_rank]) if sp else (lambda t: t[mesh.dp_rank])
    x = mine(X).clone().requires_grad_()
    y = moe(x)
    y.backward(mine(G))
    w = {k: v.clone().requires_grad_() for k, v in dense_weights(moe).items()}
    Xr = X.clone().requires_grad_()
    out, _, _, _ = reference_moe(Xr.reshape(-1, H), w, topk=TOPK, ffn=_fp8_ffn(recipe))
    (out.view(X.shape) * G).sum().backward()
    assert routing_margin(Xr.detach().reshape(-1, H) @ w["router"].detach().T, TOPK) >= MARGIN, "take another seed"
    grads = dense_weights(moe, grads=True)
    for name, grad in grads.items():
        if name == "router" and mesh.dp_size > 1:
            dist.all_reduce(grad, group=mesh.dp_group)
    return (y, mine(out.view(X.shape)).detach()), (x.grad, mine(Xr.grad)), [(grads[k], w[k].grad) for k in grads]


SPLITS = {  # tp, sequence parallel, ep, etp
    "ep2": (1, False, 2, None), "tp2sp-ep2-etp1": (2, True, 2, 1), "tp2sp-etp2": (2, True, 1, None),
}


@distributed(world_size=2)
def test_the_fp8_moe_layer_is_the_serial_fp8_layer_at_ep_and_etp_splits():
    """docs/fp8.md: per-expert scales, each expert's rows all on the ranks holding it, the amaxes etp splits reduced
    over etp: every split's output and gradients are the serial fp8 layer's (fp32, 1e-5)."""
    for split, (tp_size, sp, ep, etp) in SPLITS.items():
        mesh = tp.init_mesh(tp=tp_size, ep=ep, etp=etp)
        for recipe in RECIPES:
            torch.manual_seed(0)
            moe = tp.moe.MoE(H, F, E, TOPK, sequence_parallel=sp, fp8_recipe=recipe)
            checks = _serial_fp8_moe(moe, mesh, recipe, sp, seed=3)
            for i, (ours, ref) in enumerate((*checks[:2], *checks[2])):
                assert_close(ours, ref, 1e-5 * max(1.0, ref.abs().max().item()), f"{split} {recipe} #{i}")
        tp.destroy_mesh(keep_groups=True)


@distributed(world_size=2)
def test_without_the_etp_reduction_the_fp8_experts_differ_from_serial():
    """The reduction the previous test relies on matters at etp 2: each slice's own tensorwise amaxes give another
    output. (Rowwise's power-of-two scales move a value's e4m3 rounding only where it falls among e4m3's subnormals:
    unreduced, the output differs from the serial one by ~1e-8 of its magnitude here.)"""
    mesh = tp.init_mesh(tp=2)
    for recipe in ("tensorwise",):
        torch.manual_seed(0)
        moe = tp.moe.MoE(H, F, E, TOPK, sequence_parallel=True, fp8_recipe=recipe)
        moe.experts.fp8_scaling = lambda which: Fp8Scaling(recipe)  # (the slice's own amaxes)
        (y, ref), *_ = _serial_fp8_moe(moe, mesh, recipe, True, seed=3)
        error = (y - ref).abs().max().reshape(1)
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        assert error.item() > 1e-3 * ref.abs().max().item(), f"{recipe}: {error.item()}"


def test_a_rowwise_fp8_moe_job_trains_the_serial_curve_with_ep_inside_tp_and_at_etp_2(tmp_path):
    """docs/fp8.md: ep within the tp group under SP, and etp, keep the job's serial rowwise fp8 curve (1e-5; measured
    equal to 1e-7). (Tensorwise's drifts ~5e-5 in 3 steps: see the docs.)"""
    sp = ["--pp", "1", "--dp", "1", "--sequence-parallel"]
    splits = {"tp2sp-ep2-etp1": (2, ["--tp", "2", "--ep", "2", "--etp", "1", *sp]),
              "tp2sp-etp2": (2, ["--tp", "2", "--ep", "1", *sp])}
    assert_serial_fp8_curve(tmp_path, splits, model=["--model", "tiny-moe"], recipe="rowwise", tol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_compiled_fp8_moe_layer_is_the_eager_one(recipe):
    """Under torch.compile (fullgraph, tp.moe.dynamic_shapes: what the job does on a GPU) the fp8 grouped GEMMs run as
    custom ops (tensorwise's passing its kept casts between them): the same output and gradients as eager, no graph
    break."""
    tp.init_mesh()
    try:
        torch.manual_seed(0)
        moe = tp.moe.MoE(H, F, E, TOPK, fp8_recipe=recipe)
        x = randn(R, B, H, seed=5, dtype=torch.float32, requires_grad=True)
        results = []
        for run in (moe, torch.compile(moe, fullgraph=True)):
            with tp.moe.dynamic_shapes():
                y = run(x)
            y.backward(torch.ones_like(y))
            results.append([y.detach(), x.grad, moe.experts.fc1.grad, moe.experts.fc2.grad])
            x.grad = moe.experts.fc1.grad = moe.experts.fc2.grad = None
        for i, (ours, ref) in enumerate(zip(*results)):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"#{i}: {m}")
    finally:
        tp.destroy_mesh()
