"""The planner's node profiles: a device's roofline profile (bench.roofline.Hardware, shared with bench.intensity) plus
what a training plan also needs (memory, achieved efficiencies, per-op overhead); the GPU nodes and the CPU node
measured on this machine."""
import json
import os
import re
from dataclasses import dataclass, replace

from ..common import RESULTS
from ..roofline import HARDWARE, Hardware


@dataclass(frozen=True)
class Cluster:
    """A node type for bench.plan: the device's roofline profile plus what a training plan also needs.
    Bandwidths per device and direction; efficiencies are fractions of the datasheet figure actually achieved."""
    name: str
    device: Hardware  # flops, hbm, link (inside a node), inter_node, gpus_per_node, element_size, latency
    memory: float  # bytes of device memory
    reserved: float  # bytes the model cannot use (CUDA context, NCCL buffers, allocator fragmentation)
    gemm_efficiency: float  # of device.flops, by large GEMMs
    comm_efficiency: float  # of link / inter_node, by ring collectives
    attention_efficiency: float  # of device.flops, by flash attention (forward + backward)
    op_overhead: float  # seconds per eager op and kernel launch not hidden behind the device queue
    source: str
    cores: int = 0  # CPU: ranks share this many cores (0: one device per rank)
    cudnn_attention_efficiency: float = 0.0  # of device.flops, by cuDNN's fused attention (Software "cudnn"); 0: as
    # attention_efficiency
    # measured attention kernels by sequence length: {kernel ("cudnn" | "flash"): {"fwd" | "bwd": ((s, TFLOP/s), ...)}},
    # each rate interpolated in log s between the points (flat beyond them); a missing one: the efficiency above
    attention_rates: dict | None = None
    sms: int = 0  # streaming multiprocessors: GEMM tiles fill them in waves (bench.plan.gemm); 0: no tiles (CPU)
    launch_overhead: float = 0.0  # host seconds per kernel launch, exposed only where the host cannot run ahead
    # (after a host sync: bench.plan.moe_time)


# The H100's achieved fractions (sources in the profile's `source`); bench/plan/validation.py checks them against
# published H100 runs without refitting them.
H100_GEMM = 0.632  # bench.plan.gemm.fit_efficiency() over the committed GPU runs (tests/test_plan.py checks it)
# Attention by sequence length on H100 SXM5, head dim 128, TFLOP/s: FlashAttention-3 forward (pytorch/benchmark PR
# #2391's table, batch·sequence = 16k, 16 heads), and backward of cuDNN and FlashAttention-2 (Shah et al. 2024,
# FlashAttention-3, the figure "Attention backward speed, head dim 128 (H100 80GB SXM5)"). "cudnn" (Transformer
# Engine's fused attention): FA3's forward, cuDNN's backward; "flash" (SDPA's FlashAttention-2): FA2's backward, its
# forward at the FA3 paper's 35 % (attention_efficiency).
H100_ATTENTION = {
    "cudnn": {"fwd": ((512, 430), (1024, 517), (2048, 566), (4096, 590), (8192, 614), (16384, 621)),
              "bwd": ((512, 305), (1024, 408), (2048, 465), (4096, 499), (8192, 518), (16384, 516))},
    "flash": {"bwd": ((512, 214), (1024, 260), (2048, 291), (4096, 310), (8192, 318), (16384, 322))},
}
H100_SMS, A100_SMS = 132, 108  # NVIDIA H100 (SXM5) and A100 Tensor Core GPU architecture whitepapers
# Host time per eager op and kernel launch on an H100 node: "~5–25 µs of CPU-side work per op" (Python, autograd,
# the ATen dispatcher and cudaLaunchKernel, jiahuanglin.xyz "From PyTorch op to kernel launch"): the lower end
LAUNCH_OVERHEAD = 5e-6
H100_COMM = 370 / 450
H100_CUDNN_ATTENTION = 614 / 989
# Device memory as the driver reports it (nvidia-smi's total): the "80 GB" of both datasheets is 80 GiB of HBM, less
# what the driver keeps on the H100 — "NVIDIA H100 80GB HBM3 ... 81559MiB" (nvidia-smi in NVIDIA/nccl issue #1264),
# A100 80GB 81920MiB (modal-labs/modal-client PR #2797's nvidia-smi totals)
H100_MEMORY = 81559 * 2**20  # 85.5e9 bytes
A100_MEMORY = 81920 * 2**20  # 85.9e9 bytes
# The H800 (DeepSeek-V3's GPU): the H100 SXM5 with NVLink at 400 GB/s both directions (NVIDIA's H800 datasheet)
H800 = replace(HARDWARE["h100-nvlink"], name="h800-nvlink", link=200e9,
               source="NVIDIA H800 SXM5: the H100 SXM5's compute and memory, NVLink 400 GB/s both directions = "
                      "200 GB/s per direction; across nodes 400 Gb/s InfiniBand = 50 GB/s per GPU (DeepSeek-V3 report "
                      "arXiv:2412.19437 §3.1, §3.2.2)")
# The H200 SXM: the H100 SXM5's GH100 compute (989 TFLOP/s bf16 dense, 132 SMs) with 141 GB of HBM3e at 4.8 TB/s
# (NVIDIA H200 datasheet); its memory as torch reports it on our H200 (bench/results/gpu/h200-run1, env: 139.8 GiB)
H200 = replace(HARDWARE["h100-nvlink"], name="h200-nvlink", hbm=4.8e12,
               source="NVIDIA H200 SXM: the H100 SXM5's compute, HBM3e 4.8 TB/s, 141 GB (NVIDIA H200 datasheet)")
H200_MEMORY = 139.8 * 2**30  # 150.1e9 bytes
CLUSTERS = {
    "h100-sxm": Cluster(
        "h100-sxm", HARDWARE["h100-nvlink"], memory=H100_MEMORY, reserved=3e9,
        gemm_efficiency=H100_GEMM, comm_efficiency=H100_COMM, attention_efficiency=0.35,
        cudnn_attention_efficiency=H100_CUDNN_ATTENTION, op_overhead=0.0, sms=H100_SMS,
        attention_rates=H100_ATTENTION,
        launch_overhead=LAUNCH_OVERHEAD,
        source="device: bench.roofline's h100-nvlink (NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 "
               "TB/s, NVLink 450 GB/s per direction, 80 GB HBM3: 81559 MiB as nvidia-smi reports it); "
               "between nodes one ConnectX-7 NDR 400 Gb/s = 50 GB/s "
               "per GPU (DGX H100: 8 per node); 132 SMs. Achieved fractions, each measured or published, none fitted "
               "to a validation row: gemm 0.632 — the median over bench.kernels' 27 timed training GEMMs (hidden 4096, "
               "8192 tokens, tp 1 and 4; forward, backward, wgrad; two runs) of torch's (cuBLAS) bf16 TFLOP/s on an "
               "H200 (same GH100 compute at 700 W, 132 SMs) over 989 times the shape's useful tile-wave fraction "
               "(bench.plan.gemm; bench/results/gpu/h200-run2 and -run4, bench/RESULTS.md); comm 0.822 — NCCL's "
               "effective NVLink bandwidth on H100, 370 of 450 GB/s after ~20 % protocol overhead (S. Jeaugey, NVIDIA, "
               "nccl-tests issue #212), used for the NIC too; attention 0.35 — FlashAttention-2 (torch SDPA's flash "
               "kernel) forward on H100 (FlashAttention-3 paper, Shah et al. 2024, abstract), its backward by sequence "
               "length from that paper's backward figure (318 TFLOP/s at 8k); cuDNN/FA3-class fused attention "
               "forward by sequence length, 0.62 at 8192 (FlashAttention-3, head dim 128, 614 TFLOP/s on H100: "
               "pytorch/benchmark PR #2391; the paper's best is 740, 75 %), backward cuDNN's curve from the paper "
               "(518 at 8k); reserved 3 GB: an allowance, not measured; launches "
               "hidden (asynchronous, kernels >> 5 us) but after a host sync (MoE dispatch), 5 us each"),
    # bench.mfu's one-GPU rows on our H200s check it (bench.plan.measured)
    "h200": Cluster(
        "h200", H200, memory=H200_MEMORY, reserved=3e9,
        gemm_efficiency=H100_GEMM, comm_efficiency=H100_COMM, attention_efficiency=0.35,
        cudnn_attention_efficiency=H100_CUDNN_ATTENTION, op_overhead=0.0, sms=H100_SMS,
        attention_rates=H100_ATTENTION, launch_overhead=LAUNCH_OVERHEAD,
        source="device: the H200 SXM, the H100 SXM5's GH100 compute (989 TFLOP/s bf16 dense, 132 SMs) with HBM3e at "
               "4.8 TB/s and 141 GB (NVIDIA H200 datasheet; 139.8 GiB as torch reports it on our H200, "
               "bench/results/gpu/h200-run1); NVLink and the NIC as h100-sxm. Achieved fractions the h100-sxm "
               "profile's, not refitted (its GEMM fraction was measured on this H200)"),
    "h800": Cluster(
        "h800", H800, memory=H100_MEMORY, reserved=3e9,
        gemm_efficiency=H100_GEMM, comm_efficiency=H100_COMM, attention_efficiency=0.35,
        cudnn_attention_efficiency=H100_CUDNN_ATTENTION, op_overhead=0.0, sms=H100_SMS,
        attention_rates=H100_ATTENTION, launch_overhead=LAUNCH_OVERHEAD,
        source="device: the H800 SXM5, an H100 SXM5 (same GH100 compute, 989 TFLOP/s bf16 dense, 3.35 TB/s, 80 GB "
               "HBM3, 132 SMs) with NVLink cut to 400 GB/s both directions (200 GB/s each way; the H100's 900), "
               "NVIDIA's H800 datasheet; nodes as DeepSeek-V3's cluster (Liu et al. 2024, DeepSeek-V3 Technical "
               "Report, arXiv:2412.19437, §3.1 'Compute Clusters': 2048 H800, 8 per node over NVLink and NVSwitch, "
               "InfiniBand between nodes, 400 Gb/s = 50 GB/s per GPU, §3.2.2's IB figure). Achieved fractions the "
               "h100-sxm profile's, not refitted: comm 0.822 gives 164 GB/s of NVLink, the report's §3.2.2 'NVLink "
               "offers a bandwidth of 160 GB/s'"),
    "a100-80g": Cluster(
        "a100-80g", HARDWARE["a100-nvlink"], memory=A100_MEMORY, reserved=3e9,
        gemm_efficiency=0.79, comm_efficiency=0.5, attention_efficiency=0.5, op_overhead=0.0, sms=A100_SMS,
        launch_overhead=LAUNCH_OVERHEAD,
        source="device: bench.roofline's a100-nvlink (NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s bf16/fp16 "
               "dense, 2.039 TB/s, NVLink 300 GB/s per direction, 80 GB HBM2e: 81920 MiB as nvidia-smi reports "
               "it); between nodes one HDR 200 Gb/s = 25 "
               "GB/s per GPU (DGX A100 / Selene: 8 compute HDR NICs per node, Narayanan et al. 2021 §5); attention "
               "0.5: FlashAttention-2 paper (Dao 2023): 50-73 % of A100 peak; gemm 0.79 (of a full tile-wave: "
               "bench.plan.gemm; 108 SMs) and comm 0.5: calibrated on the 18 published A100 figures (Narayanan et "
               "al. 2021 Table 1, Korthikanti et al. 2022 Table 5; bench/plan/validation.py calibrate(), mean "
               "|error| 2.3 %); reserved 3 GB: an allowance, not measured"),
}
CPU_MEASURED = "cpu-measured"
PROFILES = (*CLUSTERS, CPU_MEASURED)  # --hardware's choices
INTENSITY_JSON = os.path.join(RESULTS, "intensity", "intensity.json")


def cpu_cluster(path=INTENSITY_JSON, *, op_overhead=0.0, comm_efficiency=1.0):
    """The "cpu-measured" node: bench.intensity's measurements on this machine (its JSON), one rank per process with
    one thread, ranks beyond the cores sharing them. The square-GEMM peak was timed with every core (torch's default
    threads), so one rank's compute is peak / cores; gemm efficiency 1 (the peak is a measured GEMM); no flash
    kernel on CPU, so attention runs at the GEMM rate; device memory: this machine's RAM; eager dispatch costs
    `op_overhead` per op (bench.plan fits it to bench.train's 1x1x1 run: bench/plan/validation.py)."""
    with open(path) as f:
        measured = json.load(f)["measured"]
    cores = int(re.search(r"(\d+) cores", measured["device"]).group(1)) if "cores" in measured["device"] else 1
    device = Hardware(CPU_MEASURED, flops=measured["peak_flops"] / cores, hbm=measured["bandwidth"],
                      link=measured["link"], latency=measured["latency"], dtype=measured["dtype"],
                      element_size=measured["element_size"], gpus_per_node=cores, inter_node=measured["link"],
                      source=f"bench.intensity on {measured['device']} ({path}): square-GEMM peak / cores, copy "
                             "bandwidth, link bandwidth and per-collective latency fitted to the timed gloo "
                             "collectives")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Cluster(CPU_MEASURED, device, memory=ram, reserved=0.0, gemm_efficiency=1.0,
                   comm_efficiency=comm_efficiency, attention_efficiency=1.0, op_overhead=op_overhead,
                   source=device.source, cores=cores)
