"""Tile configurations for the matmul kernels.

Naming is from the output tile's point of view in every kernel: BLOCK_M × BLOCK_N output tile, BLOCK_K reduction step
(for dgrad the "N" axis is the linear's K and the reduction runs over the linear's N; for wgrad the reduction runs
over tokens). GROUP_SIZE_M = 8 everywhere: consecutive programs sweep 8 row-tiles before moving to the next column
tile, so the B tiles they share stay in L2.

On GPU @triton.autotune picks one config per (M, N, K, dtypes, ...) from a small family-specific set (the
launching device's family, minus configs whose operand staging overflows its shared memory for the dtype, is
selected by the `pruner` hook):
- Hopper (sm90, 228 KB smem/SM): 64-wide K steps, up to 128×256 tiles with 8 warps and 3 stages
  (3·(128·64 + 64·256)·2 B = 144 KB of bf16 staging), plus 128×128 / 64×128 fallbacks for narrow shards.
- Ampere (sm80, 164 KB smem/SM): the same tiles with 32-wide K steps and 4–5 stages (the classic Triton tutorial
  set); 128×256×64×3 stages would not fit next to the epilogue.
fp32/fp64 operands (2x/4x the bytes) and the kernels staging several operands per step (SwiGLU forward: two weight
tiles; dgrad with an activation: g and z, or g, gate and up for SwiGLU) overflow with the big tiles: the pruner drops
those, and a 64x64x32 two-stage config in each family fits every kernel and dtype. 128x128 tiles use 8 warps: with
4, the fused epilogues (GELU, main_grad accumulation) spill (seen in ptxas -v, tests/test_kernels_compile.py).

Kernels holding two fp32 accumulators (SwiGLU forward) or doing fp32 elementwise work in the prologue (dgrad with an
activation) get the subset with BLOCK_M·BLOCK_N ≤ 128·128: a 128×256 fp32 tile is already 128 registers/thread at
8 warps, and a second one would spill.

Under TRITON_INTERPRET=1 there is exactly one config: multi-config autotune needs a GPU benchmarker, and warps /
stages mean nothing to the interpreter. 32×32×32 keeps several tiles per test shape (so masks and the grouped order are
exercised) while staying fast in numpy.
"""
import functools
import os
import re

import numpy
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _cfg(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_SIZE_M": 8},
                         num_warps=warps, num_stages=stages)


HOPPER_CONFIGS = [
    _cfg(128, 256, 64, 8, 3),
    _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 3),
    _cfg(64, 128, 64, 4, 4),
    _cfg(128, 64, 64, 4, 4),
    _cfg(64, 64, 32, 4, 2),  # the fallback that fits every dtype and kernel (fp64 dgrad-swiglu: 160 KB)
]

AMPERE_CONFIGS = [
    _cfg(128, 256, 32, 8, 3),
    _cfg(256, 128, 32, 8, 3),
    _cfg(128, 128, 32, 8, 4),
    _cfg(128, 64, 32, 4, 4),
    _cfg(64, 128, 32, 4, 4),
    _cfg(64, 64, 32, 4, 4),
    _cfg(64, 64, 32, 4, 2),  # the fallback, as above (fits sm80's 163 KB)
]

INTERPRETER_CONFIG = _cfg(32, 32, 32, 4, 1)

# Max dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin) by compute capability, for when
# the device cannot be asked (ahead-of-time compilation, tests): H100/B200, A100, and the sm86/sm89 parts.
_SHARED_BY_CAPABILITY = {(9, 0): 232448, (10, 0): 232448, (8, 0): 166912, (8, 7): 166912}
_SHARED_DEFAULT = 101376


@functools.cache
def _family(device_index):
    import torch

    return HOPPER_CONFIGS if torch.cuda.get_device_capability(device_index)[0] >= 9 else AMPERE_CONFIGS


@functools.cache
def _max_shared(device_index):
    import torch

    try:
        return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
    except Exception:  # noqa: BLE001 - no driver: fall back to the documented figure
        return _SHARED_BY_CAPABILITY.get(tuple(torch.cuda.get_device_capability(device_index)), _SHARED_DEFAULT)


def shared_bytes(config, elem_bytes, a_tiles=1, b_tiles=1):
    """Pipelined operand staging: every stage holds a_tiles [BLOCK_M, BLOCK_K] and b_tiles [BLOCK_K, BLOCK_N] tiles.

    An upper bound of what Triton allocates (its pipeliner may keep some loads fewer stages deep); it matches the
    compiled plain GEMM exactly (e.g. bf16 128x256x64, 3 stages: 147456 B).
    """
    k = config.kwargs
    tile_elements = a_tiles * k["BLOCK_M"] * k["BLOCK_K"] + b_tiles * k["BLOCK_K"] * k["BLOCK_N"]
    return config.num_stages * elem_bytes * tile_elements


def pruner(operand_tiles=lambda constexprs: (1, 1), epilogue_bytes=lambda constexprs, elem_bytes: 0):
    """An early_config_prune hook keeping the launching GPU's family, minus configs whose staging overflows its
    shared memory for this dtype. `operand_tiles(constexprs) -> (a_tiles, b_tiles)` per pipeline stage;
    `epilogue_bytes(constexprs, elem_bytes)`: shared memory per element of the output tile that the epilogue
    stages on top of the operands (the TMA stores of the persistent kernels; 0 for pointer stores).

    Chosen at the first launch rather than at import, so importing the kernels never initialises CUDA (a parent
    process that has touched CUDA cannot fork CUDA workers). Without such pruning fp32/fp64 (2x/4x the bytes) and
    the many-operand kernels have candidates that cannot launch; if all of a family failed, the autotuner would pick
    one anyway and the launch would raise OutOfResources.
    """

    def prune(configs, named_args, **kwargs):
        # (a tensor descriptor's tensor is its .base)
        tensors = (getattr(v, "base", v) for v in named_args.values())
        tensor = next((t for t in tensors if hasattr(t, "device") and t.device.type == "cuda"), None)
        if tensor is None:
            return configs
        index = tensor.device.index if tensor.device.index is not None else 0
        family = [c for c in configs if any(c is f for f in _family(index))] or configs
        constexprs = {**named_args, **kwargs}
        a_tiles, b_tiles = operand_tiles(constexprs)
        elem, per_output = tensor.dtype.itemsize, epilogue_bytes(constexprs, tensor.dtype.itemsize)

        def size(c):
            return shared_bytes(c, elem, a_tiles, b_tiles) + per_output * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]
        limit = _max_shared(index)
        fitting = [c for c in family if size(c) <= limit] or [min(family, key=size)]
        tune = os.environ.get("TP_KERNELS_TUNE", "")
        if tune == "one":  # the first fitting config only (bench.gpu_check compiles every test shape in minutes)
            return fitting[:1]
        if tune.isdigit():  # one candidate by its place in the kernel's list (bench.gpu_sections.tile_sweep)
            if int(tune) >= len(family):
                raise ValueError(f"TP_KERNELS_TUNE={tune}: this kernel has {len(family)} candidates (0-based)")
            return [family[int(tune)]]
        return fitting

    return prune


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


@functools.cache  # (checked at every interpreted launch)
def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str | None:
    """The one-line reason these Triton and NumPy versions cannot run the GEMM kernels under TRITON_INTERPRET=1,
    or None. Triton < 3.7's interpreter turns a loop bound (`range(tl.cdiv(K, BLOCK_K))`) into a Python int with
    int() of a one-element array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars", triton-lang/triton#9171; Triton 3.7.0 squeezes the array first). Compiled GPU kernels are unaffected."""
    if _major_minor(triton_version) >= (3, 7) or _major_minor(numpy_version) < (2, 4):
        return None
    return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run the GEMM kernels with NumPy "
            f"{numpy_version} (its K loop raises 'only 0-dimensional arrays can be converted to Python scalars'; "
            f"fixed in Triton 3.7): pip install 'numpy<2.4', or Triton >= 3.7, or use the torch backend")


def check_interpreter() -> None:
    """Raise interpreter_numpy_problem's line for the installed versions, before a GEMM kernel runs interpreted."""
    problem = interpreter_numpy_problem(triton.__version__, numpy.__version__)
    if problem:
        raise RuntimeError(problem)


# The persistent TMA kernels' candidates on sm90 (kernels.triton_hopper), as (BLOCK_M, BLOCK_N, BLOCK_K, warps,
# stages): Triton's persistent-matmul tutorial tiles (128x256x64 with 8 warps, 3 stages; 128x128x64) and narrower
# ones for thin shards; 128x256x64 in 4 stages for the square GEMM's gap to cuBLAS at 4096 (run 3: 0.917x), which
# only the forward fits. Their epilogue stages the output tile(s) in shared memory for the TMA store, on top of the
# operand stages: the pruner counts both (pruner's epilogue_bytes), and 64x64x64 in 3 stages fits every kernel.
PERSISTENT_TILES = ((128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 3),
                    (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 3),
                    (128, 256, 64, 8, 4))  # (last: the run-3 sweep's indices kept) 99 % of sm90's shared memory


def persistent_configs(pre_hook, small_tiles=False):
    """The candidates of a persistent TMA kernel, each with the kernel's pre_hook (it gives the host-side tensor
    descriptors the config's block shapes); one config under the interpreter, as matmul_configs."""
    tiles = [(32, 32, 32, 4, 1)] if INTERPRET else PERSISTENT_TILES
    if small_tiles:
        tiles = [t for t in tiles if t[0] * t[1] <= 128 * 128]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_SIZE_M": 8}, num_warps=warps,
                          num_stages=stages, pre_hook=pre_hook) for bm, bn, bk, warps, stages in tiles]


def matmul_configs(small_tiles=False):
    """The autotune candidates (both GPU families; pruned per device at launch), or one config when interpreting."""
    if INTERPRET:
        return [INTERPRETER_CONFIG]
    configs = HOPPER_CONFIGS + AMPERE_CONFIGS
    if small_tiles:
        configs = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    return configs
