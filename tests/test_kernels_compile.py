"""Ahead-of-time compilation of the Triton kernels for real GPUs (sm_90 Hopper, sm_80 Ampere), without a GPU.

The rest of the suite runs the kernels under TRITON_INTERPRET=1, which never lowers them: layouts, the software
pipeliner, shared-memory allocation and register allocation are untested there. This module lowers every kernel all
the way to a cubin with the ptxas that ships in the Triton wheel (`triton.compile(ASTSource(...), target=GPUTarget)`)
and checks, per kernel / dtype / autotune config:

- it compiles (TTIR -> TTGIR -> LLVM -> PTX -> cubin) for the target;
- the cubin's shared memory (`compiled.metadata.shared`) fits the device's per-block opt-in maximum
  (sm90: 232448 B, sm80: 166912 B) -- otherwise the launch raises OutOfResources;
- bf16/fp16 GEMMs hit the tensor cores (wgmma on sm90, mma.sync on sm80);
- registers and spills are read from ptxas' own `-v` log (TRITON_DUMP_PTXAS_LOG=1) and reported (a summary table is
  printed by test_summary_table; spilling tensor-core configs also raise a UserWarning). Spills are a performance
  finding, not a failure.

conftest.py sets TRITON_INTERPRET=1 before anything imports Triton, so @triton.jit in this process yields interpreter
functions. The compilation therefore runs in a fresh subprocess (this file executed as a script) that imports
kernels.triton_ops with the interpreter off and CUDA hidden -- which also proves that importing the kernels needs
neither a GPU nor the interpreter. That subprocess compiles in a fork pool (one worker per core, at most 8) into a
fresh TRITON_CACHE_DIR, so every kernel really goes through ptxas.

Configs are the autotuner's own candidates: `kernel.configs` passed through its early_config_prune hook
(configs.prune_to_device_family) with fake CUDA operands and the device capability stubbed to 9.0 / 8.0, i.e. exactly
what the autotuner would benchmark on an H100 / A100. The kernel arguments are specialised the way a launch with
contiguous tensors specialises them: unit strides become constexpr 1, feature dimensions, leading strides and
pointers carry tt.divisibility=16, token counts carry nothing; the other constexprs come from triton_ops._flags.

Matrix (about 90 compiles over both archs, ~60 s wall on 2 cores; the default run compiles the sm90 half with one
candidate per specialisation, the largest, and `-m slow` every candidate and sm80): every candidate for the bf16 gelu
forward, the bf16
wgrad with ACCUMULATE (fp32 main_grad), the bf16 dgrad and the fp64 wgrad; the largest candidate for the rest
(every forward activation, fp16, swiglu forward, fp16 dgrad, wgrad without ACCUMULATE, a forward whose feature dims are
not multiples of 16); the smallest candidate for the fp32 (IEEE FMA dot: torch's default allow_tf32=False) forward and
dgrad and the fp64 forward; act_bwd at the launcher's 64x64 block; the experts'
grouped GEMM (kernels.grouped_triton: every candidate of the bf16 SwiGLU forward and of the bf16 grouped wgrad into an
fp32 main_grad, the largest for the plain, GELU and transposed-weight dgrad forms, the smallest fp32 wgrad); the
fp8 cast and the dropout kernels (forward with residual and bias; the backward with the bias gradient's partial sums).

The persistent TMA kernels (kernels.triton_hopper, sm90 only) are compiled for sm_90a with their host tensor
descriptors specialised on the config's block shapes (what a launch after the config's pre_hook passes), and their
PTX must hold wgmma and `cp.async.bulk.tensor` loads and stores (the TMA); the default run compiles each kernel's
smallest candidate, `-m slow` every candidate of each kernel's main form and the largest of the others.

Fit policy: every candidate the autotuner's pruner keeps must fit, for every dtype. (This test first found fp64 on
Hopper, fp32 dgrad-SwiGLU on both archs and bf16 dgrad-SwiGLU 128x128x64x4 on Hopper over the limit; configs.pruner
now drops what overflows and each family carries a small config that fits everything.)
"""
import json
import os
import re
import subprocess
import sys
import time
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARCHS = (90, 80)
DEFAULT_ARCHS = (90,)  # the default run compiles for Hopper (the GPUs this package is run on); -m slow adds Ampere
MAX_SHARED = {90: 232448, 80: 166912}  # cudaDevAttrMaxSharedMemoryPerBlockOptin, H100 / A100
FAMILY = {90: "HOPPER_CONFIGS", 80: "AMPERE_CONFIGS"}
WORKER_TIMEOUT_S = 1500  # -m slow compiles ~150 kernels: ~15 min on 2 busy cores

FWD = "_linear_fwd_kernel"
SWIGLU = "_swiglu_fwd_kernel"
DGRAD = "_linear_dgrad_kernel"
WGRAD = "_linear_wgrad_kernel"
ACT_BWD = "_act_bwd_kernel"
FP8_CAST = "fp8_cast:_cast_kernel"  # kernels.fp8_cast: the one-pass e4m3 / e5m2 cast (any GPU with fp8 GEMMs)
DROPOUT_ADD = "dropout_triton:_dropout_add_kernel"  # kernels.dropout_triton: counter-based dropout + residual add
DROPOUT_GRAD = "dropout_triton:_dropout_grad_kernel"  # its backward with the bias gradient's partial sums
ELEMENTWISE = (ACT_BWD, FP8_CAST, DROPOUT_ADD, DROPOUT_GRAD)  # no dot: no tensor-core check
GROUPED = "_grouped_gemm_kernel"  # kernels.grouped_triton: the experts' grouped GEMMs
GROUPED_WGRAD = "_grouped_wgrad_kernel"

_FWD_FLAGS = dict(HAS_BIAS=True, SAVE_PREACT=True)


def _spec(name, kernel, dtype, constexprs, configs="first", aligned=True, xfail=None, runtime=None, meta=None):
    """One test case: a kernel specialisation compiled for some of the autotuner's candidates on each arch.

    configs: "all" candidates, the "first" (the family's largest tile) or the "smallest" tile.
    meta: a kernel without autotuning's block constexprs (default: the 64x64 block of act_bwd and the fp8 cast).
    xfail: {arch: reason} for known, reported findings (strict: the mark must be removed once they are fixed).
    runtime: argument types replacing _runtime_args' (another stride pattern of the same kernel).
    """
    return dict(name=name, kernel=kernel, dtype=dtype, constexprs=constexprs, configs=configs, aligned=aligned,
                xfail=xfail or {}, runtime=runtime or {}, archs=ARCHS, slow=False,
                meta=meta or dict(BLOCK_M=64, BLOCK_N=64))


SPECS = [
    _spec("fwd-gelu-bf16-allcfg", FWD, "bf16", dict(ACTIVATION="gelu", **_FWD_FLAGS), configs="all"),
    _spec("fwd-gelu-fp16", FWD, "fp16", dict(ACTIVATION="gelu", **_FWD_FLAGS)),
    *[_spec(f"fwd-{act}-bf16", FWD, "bf16", dict(ACTIVATION=act, **_FWD_FLAGS))
      for act in ("none", "gelu_tanh", "silu", "relu")],
    _spec("fwd-none-nobias-bf16", FWD, "bf16", dict(ACTIVATION="none", HAS_BIAS=False, SAVE_PREACT=False)),
    _spec("fwd-gelu-bf16-unaligned", FWD, "bf16", dict(ACTIVATION="gelu", **_FWD_FLAGS), aligned=False),
    _spec("fwd-gelu-fp32", FWD, "fp32", dict(ACTIVATION="gelu", **_FWD_FLAGS), configs="smallest"),
    _spec("fwd-gelu-fp64", FWD, "fp64", dict(ACTIVATION="gelu", **_FWD_FLAGS), configs="all"),
    _spec("swiglu-fwd-bf16", SWIGLU, "bf16", dict(HAS_BIAS=True)),
    _spec("swiglu-fwd-fp16", SWIGLU, "fp16", dict(HAS_BIAS=True)),
    _spec("dgrad-bf16-allcfg", DGRAD, "bf16", {}, configs="all"),
    _spec("dgrad-fp16", DGRAD, "fp16", {}),
    _spec("dgrad-fp32", DGRAD, "fp32", {}, configs="smallest"),
    _spec("wgrad-acc-bf16-allcfg", WGRAD, "bf16", dict(ACCUMULATE=True), configs="all"),
    _spec("wgrad-acc-fp16", WGRAD, "fp16", dict(ACCUMULATE=True)),
    _spec("wgrad-noacc-bf16", WGRAD, "bf16", dict(ACCUMULATE=False)),
    _spec("wgrad-noacc-fp16", WGRAD, "fp16", dict(ACCUMULATE=False)),
    _spec("wgrad-noacc-fp64-allcfg", WGRAD, "fp64", dict(ACCUMULATE=False), configs="all"),
    _spec("act_bwd-gelu-bf16", ACT_BWD, "bf16", dict(ACTIVATION="gelu")),
    _spec("act_bwd-silu-fp16", ACT_BWD, "fp16", dict(ACTIVATION="silu")),
    _spec("act_bwd-swiglu-bf16", ACT_BWD, "bf16", dict(ACTIVATION="swiglu")),
    _spec("fp8-cast-bf16", FP8_CAST, "bf16", dict(E5M2=False)),
    _spec("fp8-cast-e5m2-bf16", FP8_CAST, "bf16", dict(E5M2=True)),  # (tensorwise's output gradients)
    _spec("dropout-add-bf16", DROPOUT_ADD, "bf16", dict(HAS_RESIDUAL=True, HAS_BIAS=True), meta=dict(BLOCK=1024)),
    _spec("dropout-grad-bf16", DROPOUT_GRAD, "bf16", {}, meta=dict(BLOCK=1024, CHUNK=64)),
    _spec("grouped-swiglu-bf16-allcfg", GROUPED, "bf16", dict(ACTIVATION="none", SWIGLU=True, SAVE_PREACT=True),
          configs="all"),
    _spec("grouped-none-bf16", GROUPED, "bf16", dict(ACTIVATION="none", SWIGLU=False, SAVE_PREACT=False)),
    _spec("grouped-gelu-fp16", GROUPED, "fp16", dict(ACTIVATION="gelu", SWIGLU=False, SAVE_PREACT=True)),
    _spec("grouped-dgrad-bf16", GROUPED, "bf16", dict(ACTIVATION="none", SWIGLU=False, SAVE_PREACT=False),
          runtime=dict(stride_bn=1, stride_bk="i32:D")),  # the weight read transposed: dx_e = dz_e · W_e
    _spec("grouped-wgrad-acc-bf16-allcfg", GROUPED_WGRAD, "bf16", dict(ACCUMULATE=True), configs="all"),
    _spec("grouped-wgrad-noacc-fp32", GROUPED_WGRAD, "fp32", dict(ACCUMULATE=False), configs="smallest"),
]

# The default run compiles the all-candidate specs' largest candidate (the family's first: the most shared memory)
# for sm90; -m slow every candidate on both archs.
SPECS = [dict(spec, slow=True) if spec["configs"] == "all" else spec for spec in SPECS] + \
    [dict(spec, name=f"{spec['name'].removesuffix('-allcfg')}-largest", configs="first", archs=(90,))
     for spec in SPECS if spec["configs"] == "all"]

# kernels.triton_hopper: the persistent TMA kernels, sm90 only (the only arch that launches them). The default run
# compiles each kernel's smallest candidate (5-30 s each on a loaded 2-core machine); -m slow the rest below.
H_FWD = "hopper:_fwd_kernel"
H_SWIGLU = "hopper:_swiglu_fwd_kernel"
H_DGRAD = "hopper:_dgrad_kernel"
H_WGRAD = "hopper:_wgrad_kernel"
H_GROUPED = "grouped_hopper:_grouped_gemm_kernel"  # kernels.grouped_hopper: the experts' grouped GEMMs on sm90
H_GROUPED_WGRAD = "grouped_hopper:_grouped_wgrad_kernel"
HOPPER_KERNELS = (H_FWD, H_SWIGLU, H_DGRAD, H_WGRAD, H_GROUPED, H_GROUPED_WGRAD)
POINTER_STORES = (H_GROUPED,)  # its output leaves through masked stores: a TMA box cannot stop at a group's end
_GROUPED_FWD = dict(ACTIVATION="none", SWIGLU=False, SAVE_PREACT=False, DGRAD=False)


def _hopper_spec(name, kernel, dtype, constexprs, configs="first", slow=False):
    return dict(_spec(name, kernel, dtype, constexprs, configs), archs=(90,), slow=slow)


HOPPER_SPECS = [
    _hopper_spec("h-fwd-gelu-bf16", H_FWD, "bf16", dict(ACTIVATION="gelu", **_FWD_FLAGS), "smallest"),
    _hopper_spec("h-swiglu-fwd-bf16", H_SWIGLU, "bf16", dict(HAS_BIAS=True), "smallest"),
    _hopper_spec("h-dgrad-bf16", H_DGRAD, "bf16", {}, "smallest"),
    _hopper_spec("h-wgrad-acc-bf16", H_WGRAD, "bf16", dict(ACCUMULATE=True), "smallest"),
    _hopper_spec("h-grouped-swiglu-bf16", H_GROUPED, "bf16", dict(_GROUPED_FWD, SWIGLU=True, SAVE_PREACT=True),
                 "smallest"),
    dict(_hopper_spec("h-grouped-dgrad-bf16", H_GROUPED, "bf16", dict(_GROUPED_FWD, DGRAD=True), "smallest"),
         runtime=dict(w_desc=("desc", "bf16", "1KN"))),  # the weight as stored: dx_e = dz_e · W_e
    _hopper_spec("h-grouped-wgrad-acc-bf16", H_GROUPED_WGRAD, "bf16", dict(ACCUMULATE=True), "smallest"),
    # -m slow: every candidate of each kernel's main form (the shared-memory fit of each), the other forms'
    # largest candidate
    _hopper_spec("h-fwd-gelu-bf16-allcfg", H_FWD, "bf16", dict(ACTIVATION="gelu", **_FWD_FLAGS), "all", slow=True),
    _hopper_spec("h-fwd-none-nobias-bf16-allcfg", H_FWD, "bf16",
                 dict(ACTIVATION="none", HAS_BIAS=False, SAVE_PREACT=False), "all", slow=True),
    *[_hopper_spec(f"h-fwd-{act}-bf16", H_FWD, "bf16", dict(ACTIVATION=act, **_FWD_FLAGS), slow=True)
      for act in ("none", "gelu_tanh", "silu", "relu")],
    _hopper_spec("h-fwd-gelu-fp16", H_FWD, "fp16", dict(ACTIVATION="gelu", **_FWD_FLAGS), slow=True),
    _hopper_spec("h-swiglu-fwd-bf16-allcfg", H_SWIGLU, "bf16", dict(HAS_BIAS=True), "all", slow=True),
    _hopper_spec("h-swiglu-fwd-nobias-fp16", H_SWIGLU, "fp16", dict(HAS_BIAS=False), slow=True),
    _hopper_spec("h-dgrad-bf16-allcfg", H_DGRAD, "bf16", {}, "all", slow=True),
    _hopper_spec("h-dgrad-fp16", H_DGRAD, "fp16", {}, slow=True),
    _hopper_spec("h-wgrad-acc-bf16-allcfg", H_WGRAD, "bf16", dict(ACCUMULATE=True), "all", slow=True),
    _hopper_spec("h-wgrad-noacc-bf16-allcfg", H_WGRAD, "bf16", dict(ACCUMULATE=False), "all", slow=True),
    _hopper_spec("h-wgrad-acc-fp16", H_WGRAD, "fp16", dict(ACCUMULATE=True), slow=True),
    _hopper_spec("h-grouped-swiglu-bf16-allcfg", H_GROUPED, "bf16", dict(_GROUPED_FWD, SWIGLU=True, SAVE_PREACT=True),
                 "all", slow=True),
    _hopper_spec("h-grouped-gelu-fp16", H_GROUPED, "fp16", dict(_GROUPED_FWD, ACTIVATION="gelu", SAVE_PREACT=True),
                 slow=True),
    _hopper_spec("h-grouped-none-bf16-allcfg", H_GROUPED, "bf16", _GROUPED_FWD, "all", slow=True),
    _hopper_spec("h-grouped-wgrad-acc-bf16-allcfg", H_GROUPED_WGRAD, "bf16", dict(ACCUMULATE=True), "all", slow=True),
    _hopper_spec("h-grouped-wgrad-noacc-bf16", H_GROUPED_WGRAD, "bf16", dict(ACCUMULATE=False), slow=True),
]
SPECS += HOPPER_SPECS

# ----------------------------------------------------------------------------------------------------------------
# Worker side: runs as `python tests/test_kernels_compile.py OUT.json` with TRITON_INTERPRET unset.
# ----------------------------------------------------------------------------------------------------------------

_A = "i32:D"  # feature dims, leading strides: multiples of 16 in every realistic model -> tt.divisibility=16
_U = "i32"  # token counts: anything


def _runtime_args(kernel, dtype, accumulate, aligned):
    """Type of every non-constexpr parameter, as a launch with contiguous tensors would specialise it."""
    p = f"*{dtype}"
    a = _A if aligned else _U
    if kernel == FWD:
        return dict(x_ptr=p, w_ptr=p, b_ptr=p, y_ptr=p, z_ptr=p, M=_U, N=a, K=a, M_BUCKET=_A,
                    stride_xm=a, stride_xk=1, stride_wn=a, stride_wk=1, stride_ym=a, stride_yn=1, stride_zm=a,
                    stride_zn=1)
    if kernel == SWIGLU:
        return dict(x_ptr=p, w_ptr=p, b_ptr=p, y_ptr=p, z_ptr=p, M=_U, F=a, K=a, M_BUCKET=_A,
                    stride_xm=a, stride_xk=1, stride_wn=a, stride_wk=1, stride_ym=a, stride_yn=1, stride_zm=a,
                    stride_zn=1)
    if kernel == DGRAD:
        return dict(dz_ptr=p, w_ptr=p, dx_ptr=p, M=_U, N=a, K=a, M_BUCKET=_A, stride_dzm=a, stride_dzk=1,
                    stride_wk=a, stride_wn=1, stride_dxm=a, stride_dxn=1)
    if kernel == WGRAD:
        # main_grad is fp32 (fp64 for fp64 operands) when accumulating, else the output has the operands' dtype.
        c = ("*fp64" if dtype == "fp64" else "*fp32") if accumulate else p
        return dict(dz_ptr=p, x_ptr=p, c_ptr=c, M=a, N=a, K=_U, K_BUCKET=_A,
                    stride_dzk=a, stride_dzm=1, stride_xk=a, stride_xn=1, stride_cm=a, stride_cn=1)
    if kernel == FP8_CAST:  # (a broadcast scale's strides are 0: no divisibility)
        return dict(t_ptr=p, scale_ptr="*fp32", out_ptr="*u8", M=_U, N=a, stride_tm=a, stride_tn=1, stride_sm=_U,
                    stride_sn=_U, stride_om=a, stride_on=1)
    if kernel == DROPOUT_ADD:  # (a 64-bit key and a threshold past 2^31: i64)
        return dict(x_ptr=p, residual_ptr=p, bias_ptr=p, out_ptr=p, samples_ptr="*i64", positions_ptr="*i64", B=_U,
                    H=a, key="i64", threshold="i64", scale="fp32")
    if kernel == DROPOUT_GRAD:
        return dict(grad_ptr=p, dx_ptr=p, partial_ptr="*fp32", samples_ptr="*i64", positions_ptr="*i64", ROWS=_U,
                    B=_U, H=a, key="i64", threshold="i64", scale="fp32")
    if kernel == ACT_BWD:
        return dict(g_ptr=p, z_ptr=p, dz_ptr=p, M=_U, N=a, F=a,
                    stride_gm=a, stride_gn=1, stride_zm=a, stride_zn=1, stride_dzm=a, stride_dzn=1)
    if kernel == GROUPED:
        return dict(a_ptr=p, b_ptr=p, c_ptr=p, z_ptr=p, offsets_ptr="*i32", E=_U, N=a, K=a, stride_am=a,
                    stride_ak=1, stride_be=a, stride_bn=a, stride_bk=1, stride_cm=a, stride_cn=1, stride_zm=a,
                    stride_zn=1)
    if kernel in HOPPER_KERNELS:
        return _hopper_args(kernel, dtype, accumulate)
    if kernel == GROUPED_WGRAD:
        c = ("*fp64" if dtype == "fp64" else "*fp32") if accumulate else p
        return dict(dz_ptr=p, x_ptr=p, c_ptr=c, offsets_ptr="*i32", N=a, K=a, stride_dzm=a, stride_dzn=1,
                    stride_xm=a, stride_xk=1, stride_ce=a, stride_cn=a, stride_ck=1)
    raise KeyError(kernel)


def _hopper_args(kernel, dtype, accumulate):
    """The persistent kernels' arguments: tensor descriptors as ("desc", dtype, block dims), resolved against the
    config's tile in _compile_one (a launch specialises a host TensorDescriptor on its dtype and block shape)."""
    d = ("desc", dtype)
    if kernel == H_FWD:
        return dict(x_desc=(*d, "MK"), w_desc=(*d, "NK"), b_ptr=f"*{dtype}", y_desc=(*d, "MH"), z_desc=(*d, "MH"),
                    M=_U, N=_A, K=_A, M_BUCKET=_A)  # H: BLOCK_N // 2 (the forward stores its tile in two halves)
    if kernel == H_SWIGLU:
        return dict(x_desc=(*d, "MK"), wg_desc=(*d, "NK"), wu_desc=(*d, "NK"), b_ptr=f"*{dtype}", y_desc=(*d, "MN"),
                    zg_desc=(*d, "MN"), zu_desc=(*d, "MN"), M=_U, F=_A, K=_A, M_BUCKET=_A)
    if kernel == H_DGRAD:
        return dict(dz_desc=(*d, "MK"), w_desc=(*d, "KN"), dx_desc=(*d, "MN"), M=_U, N=_A, K=_A, M_BUCKET=_A)
    if kernel == H_GROUPED:  # (the dgrad's spec overrides w_desc with "1KN")
        return dict(a_desc=(*d, "MK"), w_desc=(*d, "1NK"), c_ptr=f"*{dtype}", z_ptr=f"*{dtype}", offsets_ptr="*i32",
                    E=_U, M=_U, N=_A, K=_A, M_BUCKET=_A, stride_cm=_A, stride_zm=_A)
    c = "fp32" if accumulate else dtype  # fp32 main_grad
    if kernel == H_GROUPED_WGRAD:
        return dict(dz_desc=(*d, "KM"), x_desc=(*d, "KN"), c_desc=("desc", c, "1MN"), c=f"*{c}", offsets_ptr="*i32",
                    E=_U, N=_A, K=_A, M_BUCKET=_A)
    return dict(dz_desc=(*d, "KM"), x_desc=(*d, "KN"), c_desc=("desc", c, "MN"), c=f"*{c}", M=_A, N=_A, K=_U,
                K_BUCKET=_A)


def _kernel(name):
    """The kernel object (Autotuner or JITFunction) of that name, from kernels.triton_ops or kernels.grouped_triton,
    or ("hopper:" / "grouped_hopper:" names) kernels.triton_hopper / kernels.grouped_hopper."""
    import kernels.dropout_triton as dropout_triton
    import kernels.fp8_cast as fp8_cast
    import kernels.grouped_hopper as grouped_hopper
    import kernels.grouped_triton as grouped
    import kernels.triton_hopper as hopper
    import kernels.triton_ops as ops

    module, _, short = name.rpartition(":")
    if module:
        return getattr({"hopper": hopper, "grouped_hopper": grouped_hopper, "fp8_cast": fp8_cast,
                        "dropout_triton": dropout_triton}[module], short)
    return getattr(ops, name, None) or getattr(grouped, name)


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def _candidates(autotuner, kernel, dtype, constexprs, arch):
    """The configs the autotuner would benchmark on a device of this arch: its early_config_prune hook
    (configs.prune_to_device_family) applied to fake CUDA operands, with the device capability stubbed."""
    import types

    import torch

    from kernels import configs as cfgs

    prune = autotuner.early_config_prune
    if prune is None:
        return list(autotuner.configs)
    fake = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=getattr(torch, _TORCH_DTYPES[dtype]))
    named = {}
    for name, ty in _runtime_args(kernel, dtype, constexprs.get("ACCUMULATE", False), True).items():
        pointer = isinstance(ty, tuple) or (isinstance(ty, str) and ty.startswith("*"))
        named[name] = fake if pointer else (ty if isinstance(ty, int) else 4096)
    def clear():  # the per-device lru_caches hold the (stubbed) capability's answers
        for cached in (cfgs._family, cfgs._max_shared):
            cached.cache_clear()

    real = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (arch // 10, arch % 10)
    clear()
    try:
        return list(prune(autotuner.configs, named, **constexprs))
    finally:
        torch.cuda.get_device_capability = real
        clear()


def _family_configs(autotuner, arch):
    """The autotuner's candidates from this arch's family list in kernels.configs (for the import test)."""
    from kernels import configs as cfgs

    family = getattr(cfgs, FAMILY[arch])
    return [c for c in autotuner.configs if any(c is f for f in family)]


def _smallest(configs):
    return min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"],
                                       c.kwargs["BLOCK_K"] * c.num_stages, c.kwargs["BLOCK_M"]))


def _expand(specs, archs):
    jobs = []
    for spec in specs:
        obj = _kernel(spec["kernel"])
        for arch in (a for a in archs if a in spec["archs"]):
            if hasattr(obj, "configs"):  # autotuned GEMM
                cands = _candidates(obj, spec["kernel"], spec["dtype"], spec["constexprs"], arch)
                chosen = {"all": lambda: cands, "first": lambda: cands[:1],
                          "smallest": lambda: [_smallest(cands)]}[spec["configs"]]()
                metas = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in chosen]
            else:  # act_bwd, the fp8 cast, dropout: the launcher's block, Triton's default warps / stages
                metas = [spec["meta"]]
            for meta in metas:
                jobs.append(dict(spec=spec["name"], kernel=spec["kernel"], dtype=spec["dtype"], arch=arch,
                                 constexprs=spec["constexprs"], aligned=spec["aligned"], meta=meta,
                                 runtime=spec["runtime"]))
    return jobs


def _job_key(job):
    return json.dumps({k: job[k] for k in ("kernel", "dtype", "arch", "constexprs", "aligned", "meta", "runtime")},
                      sort_keys=True, default=str)


def _cost(job):
    m = job["meta"]
    big = {"fp32": 4, "fp64": 4}.get(job["dtype"], 1) * (2 if job["constexprs"].get("ACTIVATION") == "swiglu" else 1)
    return big * m.get("BLOCK_M", 64) * m.get("BLOCK_N", 64)


def _compile_one(job):
    import contextlib
    import io

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels.triton_ops as ops

    obj = _kernel(job["kernel"])
    fn = obj.fn if isinstance(obj, triton.runtime.Autotuner) else obj  # the Autotuner wraps the JITFunction
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                   "fp64": torch.float64}[job["dtype"]]
    acc, upcast, precision = ops.flags(torch_dtype)  # exactly what the launchers pass
    flags = dict(ACC_DTYPE=acc, UPCAST=upcast, DOT_PRECISION=precision)
    meta = dict(job["meta"])
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    constexprs = dict(job["constexprs"], **meta)
    runtime = _runtime_args(job["kernel"], job["dtype"], constexprs.get("ACCUMULATE", False), job["aligned"])
    runtime.update(job["runtime"])

    signature, attrs = {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr:
            if name not in constexprs:
                if name not in flags:
                    raise KeyError(f"{job['kernel']}: no value for constexpr {name}")
                constexprs[name] = flags[name]
            signature[name] = "constexpr"
            continue
        ty = runtime.pop(name)
        if isinstance(ty, tuple):  # ("desc", dtype, dims): a host tensor descriptor with the config's block shape
            _, dtype, dims = ty
            sizes = {d: meta[f"BLOCK_{d}"] for d in "MNK"} | {"H": meta["BLOCK_N"] // 2, "1": 1}
            signature[name] = f"tensordesc<{dtype}[{', '.join(str(sizes[d]) for d in dims)}]>"
            continue
        if isinstance(ty, int):  # a unit stride: Triton specialises an int argument equal to 1 into a constexpr
            signature[name] = "constexpr"
            constexprs[name] = ty
        else:
            ty, _, div = ty.partition(":")
            signature[name] = ty
            if div or ty.startswith("*"):  # torch allocations are 256-byte aligned
                attrs[(i,)] = [["tt.divisibility", 16]]
    assert not runtime, f"{job['kernel']}: arguments not in the kernel signature: {sorted(runtime)}"
    # Constexprs that are not parameters (stale spec) would be silently ignored: refuse them.
    unknown = set(constexprs) - set(fn.arg_names)
    assert not unknown, f"{job['kernel']}: unknown constexprs {sorted(unknown)}"

    result = dict(job, options=options, precision=precision)
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG=1 prints ptxas -v here
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", job["arch"], 32), options=options)
    except Exception as e:  # noqa: BLE001 -- every failure is a finding; report it
        msg = f"{type(e).__name__}: {e}"
        result.update(ok=False, error=msg[:3000], seconds=time.perf_counter() - t0)
        return result
    text = log.getvalue()
    ptx = compiled.asm.get("ptx", "")
    cubin = compiled.asm.get("cubin", b"")

    def grab(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else None

    result.update(
        ok=True, seconds=time.perf_counter() - t0, shared=compiled.metadata.shared,
        num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
        cubin_bytes=len(cubin), cubin_elf=bytes(cubin[:4]) == b"\x7fELF",
        ptx_target=(re.search(r"^\.target\s+(\S+)", ptx, re.M) or [None, None])[1],
        wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync.aligned" in ptx,
        n_wgmma=ptx.count("wgmma.mma_async"), n_tma_load=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared", ptx)),
        n_tma_store=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global", ptx)),
        regs=grab(r"Used (\d+) registers"), spill_stores=grab(r"(\d+) bytes spill stores"),
        spill_loads=grab(r"(\d+) bytes spill loads"), stack=grab(r"(\d+) bytes stack frame"),
        ptxas_log=text[-2000:])
    return result


def _worker_main(out_path, archs, names):
    sys.path.insert(0, ROOT)
    t0 = time.perf_counter()
    assert os.environ.get("TRITON_INTERPRET") in (None, "", "0"), "the worker must run without the interpreter"
    import multiprocessing

    import torch

    import kernels.triton_ops as ops
    from kernels import configs as cfgs

    info = dict(import_s=time.perf_counter() - t0, interpret=cfgs.INTERPRET, cuda=torch.cuda.is_available(),
                n_configs={k: len(getattr(ops, k).configs) for k in (FWD, SWIGLU, DGRAD, WGRAD)},
                n_family={k: {a: len(_family_configs(getattr(ops, k), a)) for a in ARCHS}
                          for k in (FWD, SWIGLU, DGRAD, WGRAD)},
                n_pruned={k: {a: len(_candidates(getattr(ops, k), k, "bf16", {}, a)) for a in ARCHS}
                          for k in (FWD, SWIGLU, DGRAD, WGRAD)})
    specs = [spec for spec in SPECS if spec["name"] in names]
    jobs = sorted(_expand(specs, archs), key=_cost, reverse=True)  # biggest first: better packing of the pool
    workers = max(1, min(len(os.sched_getaffinity(0)), 8, len(jobs)))
    # A compile two cases share (a default case's config among a slow case's) runs once: the second would hit
    # Triton's cache, which prints no ptxas log.
    unique = {}
    for job in jobs:
        unique.setdefault(_job_key(job), job)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        compiled = {_job_key(r): r for r in pool.imap_unordered(_compile_one, list(unique.values()))}
    results = [dict(compiled[_job_key(job)], spec=job["spec"]) for job in jobs]
    info.update(workers=workers, wall_s=time.perf_counter() - t0)
    with open(out_path, "w") as f:
        json.dump(dict(info=info, results=results), f)


# ----------------------------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------------------------

def _toolchain_missing():
    """Why AOT compilation cannot run here, or None."""
    try:
        from triton import knobs
        from triton.backends import backends
    except Exception as e:  # noqa: BLE001
        return f"triton unavailable: {e}"
    if "nvidia" not in backends:
        return "triton's nvidia backend is not installed"
    for tool in ("ptxas", "ptxas_blackwell"):  # sm80 uses ptxas, sm90+ ptxas-blackwell (Triton 3.9)
        try:
            getattr(knobs.nvidia, tool)
        except Exception as e:  # noqa: BLE001 -- RuntimeError("Cannot find ptxas") or an old triton
            return f"{tool} unavailable: {e}"
    return None


_MISSING = _toolchain_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"no AOT toolchain: {_MISSING}")


def _selected(items):
    """(archs, spec names) the selected test_compiles_and_fits cases need (Hopper at least, for the other tests)."""
    cases = [item.callspec.params for item in items
             if item.originalname == "test_compiles_and_fits" and hasattr(item, "callspec")]
    archs = sorted({case["arch"] for case in cases} | set(DEFAULT_ARCHS), reverse=True)
    return archs, sorted({case["spec"]["name"] for case in cases})


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aot")
    archs, names = _selected(request.session.items)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp / "cache"), TRITON_DUMP_PTXAS_LOG="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    out = tmp / "results.json"
    t0 = time.perf_counter()
    command = [sys.executable, os.path.abspath(__file__), str(out), ",".join(map(str, archs)), ",".join(names)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"AOT compile worker failed (rc={proc.returncode}) -- it imports kernels.triton_ops without a GPU "
                    f"and without the interpreter, then compiles.\nstderr:\n{proc.stderr[-6000:]}")
    data = json.loads(out.read_text())
    data["info"]["subprocess_s"] = time.perf_counter() - t0
    by_case = {}
    for r in data["results"]:
        by_case.setdefault((r["spec"], r["arch"]), []).append(r)
    for rs in by_case.values():
        rs.sort(key=lambda r: (-r["meta"].get("BLOCK_M", 0) * r["meta"].get("BLOCK_N", 0), str(r["meta"])))
    return data["info"], by_case


def _cfg_str(r):
    m, o = r["meta"], r["options"]
    tile = "x".join(str(m[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in m)
    return f"{tile} w{o.get('num_warps', 4)} s{o.get('num_stages', 3)}"


def test_worker_imports_kernels_without_gpu_or_interpreter(compiled):
    info, _ = compiled
    assert info["interpret"] is False and info["cuda"] is False
    # Off the interpreter the autotuners hold both families (configs are pruned per device at launch, not at import).
    assert info["n_configs"] == {FWD: 14, SWIGLU: 10, DGRAD: 14, WGRAD: 14}
    for k, small in ((FWD, False), (WGRAD, False), (SWIGLU, True), (DGRAD, False)):
        assert info["n_family"][k] == ({"90": 5, "80": 5} if small else {"90": 7, "80": 7}), k
        # prune_to_device_family (the autotuner's early_config_prune) keeps exactly the launching device's family.
        assert info["n_pruned"][k] == info["n_family"][k], k


def _cases():
    for spec in SPECS:
        for arch in spec["archs"]:
            marks = [] if arch in DEFAULT_ARCHS and not spec["slow"] else [pytest.mark.slow]
            if arch in spec["xfail"]:
                marks.append(pytest.mark.xfail(strict=True, reason=f"known finding (sm{arch}): {spec['xfail'][arch]}"))
            yield pytest.param(spec, arch, id=f"{spec['name']}-sm{arch}", marks=marks)


@pytest.mark.parametrize("spec, arch", list(_cases()))
def test_compiles_and_fits(compiled, spec, arch):
    """Every selected candidate compiles to a cubin for the arch; smem fits the device (see _fits_policy)."""
    _, by_case = compiled
    results = by_case.get((spec["name"], arch))
    assert results, "no compile job ran for this case"
    failures = [f"{_cfg_str(r)}: {r['error']}" for r in results if not r["ok"]]
    assert not failures, f"{spec['kernel']} {spec['dtype']} sm{arch} failed to compile:\n" + "\n".join(failures)
    over = []
    for r in results:
        where = f"{spec['kernel']} {spec['dtype']} sm{arch} {_cfg_str(r)}"
        assert r["cubin_elf"] and r["cubin_bytes"] > 0, where
        assert r["ptx_target"] in (f"sm_{arch}", f"sm_{arch}a"), (where, r["ptx_target"])
        assert r["num_warps"] == r["options"].get("num_warps", 4), where
        assert r["regs"] is not None, f"{where}: ptxas -v log not captured:\n{r['ptxas_log']}"
        if spec["kernel"] not in ELEMENTWISE and spec["dtype"] in ("bf16", "fp16"):
            tensor_core = r["wgmma"] if arch == 90 else r["mma_sync"]
            assert tensor_core, f"{where}: no {'wgmma' if arch == 90 else 'mma.sync'} in the PTX"
        if spec["kernel"] in HOPPER_KERNELS:  # Hopper-class: operand tiles in and the output out through TMA
            assert r["n_tma_load"] and (r["n_tma_store"] or spec["kernel"] in POINTER_STORES), \
                f"{where}: cp.async.bulk.tensor loads / stores in the PTX: {r['n_tma_load']} / {r['n_tma_store']}"
        if r["shared"] > MAX_SHARED[arch]:
            over.append(f"{where}: needs {r['shared']} B of shared memory, the device allows {MAX_SHARED[arch]} B")
    # Every candidate the pruner lets through must fit, whatever the dtype: one that does not would be benchmarked
    # as inf (a wasted slot) or, if it were the only one left, crash the launch with OutOfResources.
    assert not over, "\n".join(over)


def test_summary_table(compiled):
    """Prints smem / registers / spills per compiled kernel (shown with -rA); warns about spilling GEMM configs."""
    info, by_case = compiled
    rows = [r for rs in by_case.values() for r in rs]
    rows.sort(key=lambda r: (-r["arch"], r["spec"], -r["meta"].get("BLOCK_M", 0) * r["meta"].get("BLOCK_N", 0)))
    lines = [f"AOT compile: {len(rows)} kernels, {info['workers']} workers, worker wall {info['wall_s']:.1f} s "
             f"(import {info['import_s']:.1f} s), subprocess {info['subprocess_s']:.1f} s",
             f"{'arch':5} {'case':28} {'config':18} {'smem B':>7} {'limit%':>6} {'regs':>4} {'spill st/ld B':>13} "
             f"{'tc':>5} {'wgmma/tma ld/st':>15} {'time s':>6}"]
    spilling = []
    for r in rows:
        if not r["ok"]:
            lines.append(f"sm{r['arch']:<3} {r['spec']:28} {_cfg_str(r):18} FAILED: {r['error'][:200]}")
            continue
        tc = "wgmma" if r["wgmma"] else ("mma" if r["mma_sync"] else "fma")
        if r["kernel"] in ELEMENTWISE:
            tc = "-"
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        lines.append(f"sm{r['arch']:<3} {r['spec']:28} {_cfg_str(r):18} {r['shared']:>7} "
                     f"{100 * r['shared'] / MAX_SHARED[r['arch']]:>5.0f}% {r['regs']:>4} {spills:>13} {tc:>5} "
                     f"{r['n_wgmma']:>5}/{r['n_tma_load']:>4}/{r['n_tma_store']:>4} "
                     f"{r['seconds']:>6.1f}")
        if (r["spill_stores"] or r["spill_loads"]) and r["dtype"] in ("bf16", "fp16"):
            spilling.append(f"sm{r['arch']} {r['spec']} {_cfg_str(r)} ({spills} B)")
    print("\n".join(lines))
    if spilling:
        warnings.warn("register spills in tensor-core GEMM configs: " + "; ".join(spilling), stacklevel=2)
    assert all(r["ok"] for r in rows)


if __name__ == "__main__":
    _worker_main(sys.argv[1], [int(arch) for arch in sys.argv[2].split(",")], set(sys.argv[3].split(",")))
