"""Tile configurations for the matmul kernels.

Naming is from the output tile's point of view in every kernel: BLOCK_M × BLOCK_N output tile, BLOCK_K reduction step
(for dgrad the "N" axis is the linear's K and the reduction runs over the linear's N; for wgrad the reduction runs
over tokens). GROUP_SIZE_M = 8 everywhere: consecutive programs sweep 8 row-tiles before moving to the next column
tile, so the B tiles they share stay in L2.

On GPU @triton.autotune picks one config per (M, N, K, dtypes, ...) from a small family-specific set (the
launching device's family is selected by prune_to_device_family):
- Hopper (sm90, 228 KB smem/SM): 64-wide K steps, up to 128×256 tiles with 8 warps and 3 stages
  (3·(128·64 + 64·256)·2 B = 144 KB of bf16 staging), plus 128×128 / 64×128 fallbacks for narrow shards.
- Ampere (sm80, 164 KB smem/SM): the same tiles with 32-wide K steps and 4–5 stages (the classic Triton tutorial
  set); 128×256×64×3 stages would not fit next to the epilogue.
Configs that do not fit (e.g. fp32 operands) fail to compile and the autotuner scores them as infinitely slow.

Kernels holding two fp32 accumulators (SwiGLU forward) or doing fp32 elementwise work in the prologue (dgrad with an
activation) get the subset with BLOCK_M·BLOCK_N ≤ 128·128: a 128×256 fp32 tile is already 128 registers/thread at
8 warps, and a second one would spill.

Under TRITON_INTERPRET=1 there is exactly one config: multi-config autotune needs a GPU benchmarker, and warps /
stages mean nothing to the interpreter. 32×32×32 keeps several tiles per test shape (so masks and the grouped order are
exercised) while staying fast in numpy.
"""
import functools
import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _cfg(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_SIZE_M": 8},
                         num_warps=warps, num_stages=stages)


HOPPER_CONFIGS = [
    _cfg(128, 256, 64, 8, 3),
    _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(128, 64, 64, 4, 4),
]

AMPERE_CONFIGS = [
    _cfg(128, 256, 32, 8, 3),
    _cfg(256, 128, 32, 8, 3),
    _cfg(128, 128, 32, 4, 4),
    _cfg(128, 64, 32, 4, 4),
    _cfg(64, 128, 32, 4, 4),
    _cfg(64, 64, 32, 4, 5),
]

INTERPRETER_CONFIG = _cfg(32, 32, 32, 4, 1)


@functools.lru_cache(maxsize=None)
def _family(device_index):
    import torch

    return HOPPER_CONFIGS if torch.cuda.get_device_capability(device_index)[0] >= 9 else AMPERE_CONFIGS


def prune_to_device_family(configs, named_args, **kwargs):
    """early_config_prune hook: keep the candidates of the launching GPU's family.

    Chosen at the first launch rather than at import, so importing the kernels never initialises CUDA (a parent
    process that has touched CUDA cannot fork CUDA workers).
    """
    tensor = next((v for v in named_args.values() if hasattr(v, "device") and v.device.type == "cuda"), None)
    if tensor is None:
        return configs
    family = _family(tensor.device.index if tensor.device.index is not None else 0)
    kept = [c for c in configs if any(c is f for f in family)]
    return kept or configs


def matmul_configs(small_tiles=False):
    """The autotune candidates (both GPU families; pruned per device at launch), or one config when interpreting."""
    if INTERPRET:
        return [INTERPRETER_CONFIG]
    configs = HOPPER_CONFIGS + AMPERE_CONFIGS
    if small_tiles:
        configs = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    return configs
