"""GEMM rate by shape: the planner's time of one GEMM (or one grouped GEMM over equal groups) on a node profile.

A GEMM's output [m, n] is computed in tiles of 128 × 128, one thread block per tile, the tiles in waves over the
device's streaming multiprocessors (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, §3 tile
and wave quantization: a partial tile costs a whole one, a partial last wave a whole wave). The achieved rate is the
profile's GEMM efficiency (η, what a large GEMM reaches when every wave is full) times the useful fraction of the
tile-waves:

    useful = m·n·groups / (waves · SMs · 128²),   waves = ceil(groups·ceil(m/128)·ceil(n/128) / SMs)

and the GEMM takes max(FLOPs / (useful · η · peak), bytes / HBM) (bench.roofline's memory bound). A grouped GEMM
(the experts' tokens, one group per local expert) quantizes each group's tiles and fills the waves with all of them,
as one grouped kernel does. 128 × 128: cuBLAS's and CUTLASS's common Hopper bf16 tile; SMs: 132 on H100 SXM and
H200, 108 on A100 (the NVIDIA H100 and A100 whitepapers); profiles without SMs (the CPU) have no tiles.

η comes from measurements: `fit_efficiency` divides every cuBLAS (torch) rate of bench.kernels' training GEMMs in
each GPU run under bench/results/gpu/ by that shape's useful fraction and takes the median over them and the peak;
bench/plan/hardware.py's H100 figure is that fit (tests/test_plan.py checks it against the committed runs, so a new
GPU run that moves it fails until the profile takes the new value).
"""
import glob
import json
import math
import os
import statistics

from ..common import RESULTS

TILE = 128  # rows and columns of one output tile
GPU_RUNS = os.path.join(RESULTS, "gpu", "*", "kernels.json")


def useful_fraction(m, n, sms, groups=1):
    """The fraction of the tile-waves doing useful work for `groups` GEMMs with [m, n] outputs (module docstring);
    1 without SMs (no tiles)."""
    if not sms or m * n == 0:
        return 1.0
    tiles = groups * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / sms)
    return groups * m * n / (waves * sms * TILE * TILE)


def gemm_time(gemm, cluster, element_size, groups=1):
    """Seconds of `groups` equal GEMMs (a bench.roofline.Gemm each, one grouped kernel) on the profile."""
    hw = cluster.device
    rate = cluster.gemm_efficiency * hw.flops * useful_fraction(gemm.m, gemm.n, cluster.sms, groups)
    return groups * max(gemm.flops / rate, gemm.bytes(element_size) / hw.hbm)


def _outputs(row):
    """[(m, n)] of the GEMMs one bench.kernels row times: forward y[M, N]; backward dgrad [M, K] and wgrad [N, K];
    wgrad [N, K]."""
    m, n, k = row["M"], row["N"], row["K"]
    return {"fwd": [(m, n)], "bwd": [(m, k), (n, k)]}.get(row["phase"], [(n, k)])


def measured_rates(pattern=GPU_RUNS):
    """[(cuBLAS TFLOP/s, useful fraction at 132 SMs)] of every bench.kernels row in the committed GPU runs (H100 and
    H200: the same GH100 compute and 132 SMs)."""
    rows = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            for row in json.load(f)["results"]:
                fractions = [useful_fraction(m, n, 132) for m, n in _outputs(row)]
                rows.append((row["torch_tflops"], sum(fractions) / len(fractions)))
    return rows


def fit_efficiency(peak_tflops=989.0, pattern=GPU_RUNS):
    """η: the median over the measured GEMMs of rate / (useful fraction × peak)."""
    return statistics.median(rate / (useful * peak_tflops) for rate, useful in measured_rates(pattern))
