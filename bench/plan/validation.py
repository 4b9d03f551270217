"""`python -m bench.plan --validate`: the step-time model against published large runs and this package's CPU runs.

Published rows (each cited: paper or repository, table, row), their configuration pinned; what a source does not
state is said in the row's note. The implementation each run used is a fact of the row (Software): Megatron-LM
2021-22 ran fp16 with materialized attention, fused element-wise kernels, an fp16 gradient all-reduce after the
backward (no overlap) and scatter-gather p2p; NeMo / Megatron-Core 2024 on H100 run cuDNN fused attention and overlap
their tp, dp and p2p communication (the recipes' flags).

Calibrated (hardware level, never per row; `calibrate()` reproduces them): the A100's GEMM and collective efficiency,
minimising the mean |error| over the 22 A100 figures; the CPU's per-op overhead on bench.train's 1x1x1 run alone
(cpu_op_overhead(), fitted whenever the cpu-measured profile is used: the other splits are predictions). The H100's
fractions are not fitted: each is a measurement or a published figure (bench.plan.hardware), and the H100 rows
check them. Runs with a full configuration the model does not reach within 20 % are listed apart (UNREACHED), with
why; runs without one are left out: NVIDIA's NeMo / Megatron-Bridge performance tables (their H100 rows are FP8,
which the model does not price, but for GPT-OSS, whose sliding-window attention the config cannot express).
"""

import json
import os
from dataclasses import dataclass, replace

from models.config import PRESETS, PUBLISHED_MODELS, GPTConfig
from models.flops import flops_per_token

from ..common import RESULTS, print_table
from .hardware import CLUSTERS, cpu_cluster
from .search import evaluate
from .software import MEGATRON_2021, MEGATRON_2024, MEGATRON_CORE, NEMO_2024, OURS_CPU, TORCHTITAN, Software
from .stages import ACCOUNTED
from .step_time import Plan, model_flops_per_token, recompute_flops_per_token, step_time

GPT3_SHAPE = dict(vocab_size=51200, activation="gelu", norm="layernorm", bias=True, position="learned",
                  max_seq_len=2048)
NARAYANAN = "Narayanan et al. 2021 (arXiv:2104.04473), Table 1"
KORTHIKANTI = "Korthikanti et al. 2022 (arXiv:2205.05198), Tables 3 and 5"
MBS_NOTE = ("micro-batch sizes: the bigscience-workshop Megatron-LM notes' transcription of this table; vp = 1 and "
            "full recomputation (the paper's FLOP count includes it)")


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    hardware: str
    model: dict
    seq_len: int
    global_batch_size: int
    plan: Plan
    software: Software
    published: dict  # {"mfu": .., "hfu": ..}: fractions of peak
    note: str = ""
    causal_halved: bool = False  # the source's FLOP count halves causal attention (Megatron-LM since March 2025)


def _narayanan(params, heads, hidden, layers, t, p, gpus, batch, micro_batch_size, percent):
    return Row(f"GPT {params}B", f"{NARAYANAN}, row {params}B", "a100-80g",
               dict(GPT3_SHAPE, hidden_size=hidden, num_layers=layers, num_heads=heads), 2048, batch,
               Plan(t, 1, p, 1, gpus // (t * p), micro_batch_size, "full", False, "ddp"), MEGATRON_2021,
               {"hfu": percent / 100}, MBS_NOTE)


def _korthikanti(size, heads, hidden, layers, p, gpus, batch, micro_batch_size, virtual_stages, mfu, hfu, full_s,
                 present_s):
    shape = dict(GPT3_SHAPE, hidden_size=hidden, num_layers=layers, num_heads=heads)
    config = GPTConfig(**shape)
    flops = model_flops_per_token(config, 2048) * batch * 2048
    full_hfu = (flops + recompute_flops_per_token(config, 2048, "full") * batch * 2048) / (full_s * 312e12 * gpus)
    common = dict(hardware="a100-80g", model=shape, seq_len=2048, global_batch_size=batch, software=MEGATRON_2021)
    split = dict(tp=8, cp=1, pp=p, virtual_stages=virtual_stages, dp=1, micro_batch_size=micro_batch_size)
    return [
        Row(f"{size} SP+selective", f"{KORTHIKANTI}, row {size}, present work",
            plan=Plan(**split, recompute="selective", sp=True), published={"mfu": mfu / 100, "hfu": hfu / 100},
            note=f"iteration {present_s} s", **common),
        Row(f"{size} full recompute", f"{KORTHIKANTI}, row {size}, full recompute (iteration {full_s} s)",
            plan=Plan(**split, recompute="full"), published={"hfu": full_hfu},
            note="HFU derived from the published iteration time with this module's FLOP count", **common),
    ]


PUBLISHED = [
    # params (B), heads, hidden, layers, t, p, GPUs, batch, micro-batch, % of peak
    _narayanan(1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 44),
    _narayanan(3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 44),
    _narayanan(7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 46),
    _narayanan(18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 43),
    _narayanan(39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 44),
    _narayanan(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 45),
    _narayanan(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 47),
    _narayanan(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 50),
    _narayanan(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 52),
    _narayanan(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 52),
    # size, heads, hidden, layers, p, GPUs, batch, micro-batch (Table 3), virtual stages (3 for 175B and 530B: the
    # paper's interleaving, as Isaev et al.'s Calculon validation configs also set it), MFU, HFU, iteration seconds with
    # full recompute and with SP + selective (Table 5); sequence 2048, vocabulary 51200, A100 80GB, no data parallelism
    *_korthikanti("22B", 64, 6144, 48, 1, 8, 4, 4, 1, 41.5, 43.7, 1.42, 1.10),
    *_korthikanti("175B", 96, 12288, 96, 8, 64, 64, 1, 3, 51.4, 52.8, 18.13, 13.75),
    *_korthikanti("530B", 128, 20480, 105, 35, 280, 280, 1, 3, 56.0, 57.0, 49.05, 37.83),
    *_korthikanti("1T", 160, 25600, 128, 64, 512, 512, 1, 1, 56.3, 57.0, 94.42, 71.49),
]

# ---- H100, bf16 ----------------------------------------------------------------------------------------------------
# Every figure below was read in its source; what a source leaves out is said in the row's note. Throughputs in
# tokens/s are the whole job's (the sources' "Throughput in tokens per second", or batch · sequence / iteration time).
DGXC = "NVIDIA/dgxc-benchmarking (DGX Cloud benchmarking recipes, NeMo on DGX H100)"
NEMOTRON4_340B = dict(vocab_size=256000, hidden_size=18432, num_layers=96, num_heads=96, num_kv_heads=8,
                      ffn_hidden_size=73728, activation="gelu", norm="layernorm", max_seq_len=4096)
NEMOTRON4_15B = dict(vocab_size=256000, hidden_size=6144, num_layers=32, num_heads=48, num_kv_heads=8,
                     ffn_hidden_size=24576, activation="gelu", norm="layernorm", max_seq_len=4096)
GROK1 = dict(vocab_size=131072, hidden_size=6144, num_layers=64, num_heads=48, num_kv_heads=8, ffn_hidden_size=32768,
             max_seq_len=8192, num_experts=8, moe_router_topk=2)
SQUARED_RELU = ("squared ReLU priced as GELU (one up-projection, the same GEMMs); LayerNorm1p as LayerNorm; shape: "
                "Nemotron-4 340B's model_config.yaml (96 layers, hidden 18432, FFN 73728, 96 heads, 8 query groups)")
NEMOTRON15_SHAPE = ("Parmar et al. 2024 (arXiv:2402.16819) Table 1: 32 layers, hidden 6144, 48 heads, 8 KV heads, "
                    "sequence 4096, vocabulary 256,000; FFN 24576 = 4h (12.5B non-embedding parameters, §2); squared "
                    "ReLU priced as GELU")


# The optimizer each recipe's config names (what its state costs per parameter; the NeMo 24.09 container runs them):
# NeMo-Framework-Launcher's llama3_1_70b.yaml and llama3_1_405b.yaml run `distributed_fused_adam` (Apex's
# DistributedFusedAdam through NeMo) at its default fp32 `dtype`: NeMo's MegatronBaseModel.setup_optimization then
# keeps, under bf16 parameters, only their 16-bit remainders (store_param_remainders) beside the fp32 moments: 2 + 8
# bytes sharded over the data-parallel (with context-parallel) ranks; the gradient buffer is in grad_sync_dtype,
# which Apex defaults to `dtype` (fp32: 4 bytes, whole). dgxc-benchmarking's nemotron4-340b-synth.yaml (the 340B
# runs' config) sets grad_sync_dtype and dtype to bf16: no master copy (setup_optimization stores none when the
# optimizer's dtype is the model's), bf16 moments (4 bytes sharded) and a bf16 gradient buffer (2). Its
# nemotron4-15b-synth.yaml runs `mcore_distributed_optim` (Megatron-Core's distributed optimizer: fp32 master and
# moments, and fp32 gradients, NeMo's grad_reduce_in_fp32 for the default grad_sync_dtype): NEMO_2024's default.
NEMO_FUSED_ADAM = replace(NEMO_2024, name="NeMo 24.x (TE, distributed_fused_adam)", optimizer_bytes=10)
NEMO_FUSED_ADAM_BF16 = replace(NEMO_2024, name="NeMo 24.x (TE, distributed_fused_adam in bf16)", grad_bytes=2,
                               optimizer_bytes=4)


def _dgxc(name, path, model, seq_len, gpus, batch, plan, tokens_per_s, note, software=NEMO_2024):
    return Row(f"{name} ({gpus} H100)", f"{DGXC}, {path}: {gpus} GPUs, GBS {batch}, {tokens_per_s:,} tokens/s",
               "h100-sxm", model, seq_len, batch, plan, software, {"tokens_per_s": tokens_per_s}, note)


def _nemotron15(dp, iteration_s, mfu_percent, batch):
    return Row(f"Nemotron-4 15B ({8 * dp} H100)",
               f"Parmar et al. 2024 (arXiv:2402.16819), Table 2, data-parallel size {dp}: {8 * dp} GPUs, batch "
               f"{batch}, iteration {iteration_s} s, MFU {mfu_percent} %", "h100-sxm", NEMOTRON4_15B, 4096, batch,
               Plan(8, 1, 1, 1, dp, 1, "none", True, "zero1"), MEGATRON_2024,
               {"tokens_per_s": batch * 4096 / iteration_s},
               f"tp 8 + dp with the distributed optimizer (§2); micro-batch not published: 1 assumed (Megatron's "
               f"default), batch/dp = {batch // dp} micro-batches; SP assumed with tp; {NEMOTRON15_SHAPE}")


LLAMA31_70B_NOTE = ("llama3.1/README_70b.md: 24.09 BF16, TP 4, PP 4, CP 2, VP 5, MBS 1, sequence 8192; the NeMo "
                    "recipe (NeMo-Framework-Launcher llama3_1_70b.yaml): SP, no recompute, distributed_fused_adam "
                    "(fp32 state) with overlapped grad/param sync, ub_tp_comm_overlap, overlap_p2p_comm")
NEMOTRON340_NOTE = ("nemotron/README_340b.md: 24.11 BF16, TP 8, PP 8, VP 12, MBS 1, sequence 4096; SP, no recompute "
                    "and the 70B recipe's overlaps assumed (the README gives only the parallel sizes); its config "
                    "(dgxc-benchmarking nemotron4-340b-synth.yaml, configure.sh): distributed_fused_adam with bf16 "
                    "state and gradients (priced), selective recompute and NVTE_FUSED_ATTN=0 (not priced); "
                    + SQUARED_RELU)
LLAMA31_405B_NOTE = ("llama3.1/README_405b.md: 24.09 BF16, TP 8, PP 9, CP 2, VP 7, MBS 1, sequence 8192, 126 layers "
                     "(the full model from 576 GPUs up); SP, no recompute and the 70B recipe's overlaps assumed; "
                     "distributed_fused_adam (fp32 state) as the launcher's llama3_1_405b.yaml, whose "
                     "num_query_groups is 16 (priced: Llama 3.1's 8)")
NEMOTRON15_NEMO_NOTE = ("nemotron/README_15b.md: BF16, TP 4, PP 1, MBS 4, GA 4, sequence 4096; SP, no recompute and "
                        f"the 70B recipe's overlaps assumed; {NEMOTRON15_SHAPE}")
MIXTRAL = ("Megatron-LM megatron/core/transformer/moe/README.md: \"468 TFLOPS for Mixtral 8X7B bf16 training\" "
           "(MCore v0.9) and its reference mapping for Mixtral 8x7B (dropless, all-to-all, BF16): 64 H100, sequence "
           "4096, TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256")
GROK_NOTE = ("Dev BF16, sequence 8192, TP 4, PP 8, CP 2, EP 8, VP 8, MBS 1, 64 layers (the full model from 512 GPUs "
             "up); shape: xai-org/grok-1 run.py (64 layers, 48 q / 8 kv heads of 128, 8 experts top-2, vocabulary "
             "128·1024, FFN 32768 from its ffn_size(6144, 8)); the table's DP (1 at 512, 4 at 2048 GPUs) is the "
             "experts' data-parallel size: GPUs / (TP·CP·PP) = dp 8 and 32 = EP 8 × DP, Megatron's layout before MoE "
             "parallel folding with experts at etp = tp = 4, so the all-to-all group (ep·etp = 32 ranks) spans 4 "
             "nodes; the NeMo overlaps as the 70B recipe (assumed)")
MODELZOO = "NVIDIA Megatron-MoE-ModelZoo (github.com/yanring/Megatron-MoE-ModelZoo)"
MIXTRAL_8X22B = dict(PUBLISHED_MODELS["mixtral-8x22b"], vocab_size=32000, max_seq_len=4096)
MIXTRAL_8X22B_NOTE = ("runtime_configs/benchmarking/runtime.conf (commit 3a2d8b5): TP 2, PP 8, EP 8, CP 1, VPP 7, "
                      "MBS 1, GBS 256, 56 layers, alltoall, grouped GEMM, 16 nodes, sequence 4096; "
                      "model_configs/benchmarking/Mixtral-8x22B.yaml: expert TP 1, --use-distributed-optimizer, "
                      "--overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap, SP, Transformer Engine, "
                      "flash attention, permute and router fusion, Llama2Tokenizer (vocabulary 32000), dropless; "
                      "MFU as Megatron-LM's num_floating_point_operations counts it (causal attention halved, the "
                      "router not counted: 0.02 % here)")
H100_PUBLISHED = [
    _dgxc("Llama 3.1 70B", "llama3.1/README_70b.md", PUBLISHED_MODELS["llama3-70b"], 8192, 64, 128,
          Plan(4, 2, 4, 5, 2, 1, "none", True, "zero1"), 71235, LLAMA31_70B_NOTE, NEMO_FUSED_ADAM),
    _dgxc("Llama 3.1 70B", "llama3.1/README_70b.md", PUBLISHED_MODELS["llama3-70b"], 8192, 2048, 4096,
          Plan(4, 2, 4, 5, 64, 1, "none", True, "zero1"), 2248957, LLAMA31_70B_NOTE, NEMO_FUSED_ADAM),
    _dgxc("Nemotron-4 340B", "nemotron/README_340b.md", NEMOTRON4_340B, 4096, 128, 32,
          Plan(8, 1, 8, 12, 2, 1, "none", True, "zero1"), 28432, NEMOTRON340_NOTE, NEMO_FUSED_ADAM_BF16),
    _dgxc("Nemotron-4 340B", "nemotron/README_340b.md", NEMOTRON4_340B, 4096, 2048, 512,
          Plan(8, 1, 8, 12, 32, 1, "none", True, "zero1"), 433296, NEMOTRON340_NOTE, NEMO_FUSED_ADAM_BF16),
    _dgxc("Llama 3.1 405B", "llama3.1/README_405b.md", PUBLISHED_MODELS["llama3-405b"], 8192, 576, 252,
          Plan(8, 2, 9, 7, 4, 1, "none", True, "zero1"), 120022, LLAMA31_405B_NOTE, NEMO_FUSED_ADAM),
    _dgxc("Llama 3.1 405B", "llama3.1/README_405b.md", PUBLISHED_MODELS["llama3-405b"], 8192, 2304, 1008,
          Plan(8, 2, 9, 7, 16, 1, "none", True, "zero1"), 468646, LLAMA31_405B_NOTE, NEMO_FUSED_ADAM),
    _dgxc("Nemotron-4 15B", "nemotron/README_15b.md", NEMOTRON4_15B, 4096, 64, 256,
          Plan(4, 1, 1, 1, 16, 4, "none", True, "zero1"), 366635, NEMOTRON15_NEMO_NOTE),
    _dgxc("Nemotron-4 15B", "nemotron/README_15b.md", NEMOTRON4_15B, 4096, 2048, 8192,
          Plan(4, 1, 1, 1, 512, 4, "none", True, "zero1"), 11335957, NEMOTRON15_NEMO_NOTE),
    _nemotron15(96, 0.57, 34.3, 384),
    _nemotron15(192, 0.58, 33.3, 768),
    _nemotron15(288, 0.64, 30.5, 1152),
    _dgxc("Grok-1 314B", "grok1/README_314b.md", GROK1, 8192, 512, 1024,
          Plan(4, 2, 8, 8, 8, 1, "none", True, "zero1", ep=8, etp=4), 402718, GROK_NOTE),
    _dgxc("Grok-1 314B", "grok1/README_314b.md", GROK1, 8192, 2048, 4096,
          Plan(4, 2, 8, 8, 32, 1, "none", True, "zero1", ep=8, etp=4), 1591011, GROK_NOTE),
    Row("Mixtral 8x7B (64 H100, ep 8)", MIXTRAL, "h100-sxm", PUBLISHED_MODELS["mixtral-8x7b"], 4096, 256,
        Plan(1, 1, 4, 8, 16, 1, "none", False, "zero1", ep=8, etp=1), MEGATRON_2024, {"tflops_per_gpu": 468},
        "the README states the 468 TFLOP/s and the mapping in separate sections (same model, precision and "
        "hardware); etp 1 (tp 1); the README's example script's --overlap-grad-reduce --overlap-param-gather and "
        "--use-distributed-optimizer; MFU counted as Megatron does (active experts, full attention square)"),
    Row("Mixtral 8x22B (128 H100, ep 8)", f"{MODELZOO}, best_practice/Mixtral/run_mixtral_8x22B.sh (commit 0993e66): "
        "\"Dropless training, stable performance should be around 455TFLOPS for H100\"", "h100-sxm", MIXTRAL_8X22B,
        4096, 256, Plan(2, 1, 8, 7, 8, 1, "none", True, "zero1", ep=8, etp=1), MEGATRON_CORE,
        {"tflops_per_gpu": 455}, MIXTRAL_8X22B_NOTE, causal_halved=True),
]

# H100 runs with a full published configuration the model does not reach within 20 % (shown by --validate beside the
# rows above, outside their statistics), each with why.
TORCHTITAN_PAGE = ("torchtitan's docs/performance.md (the TorchTitan paper's setup, Liang et al. 2024, "
                   "arXiv:2410.06511)")
POWER_CAPPED = ("its H100s are capped at 500 W with 96 GB HBM2e at 2.4 TB/s (Grand Teton; the page: \"the actual "
                "peak TFLOPs number is between SXM and NVL, and we don't know its exact value\"), the h100-sxm profile "
                "is the 700 W, 3.35 TB/s SXM5; eager torch ops between the GEMMs; the memory (FSDP2 resharding each "
                "block, as torchtitan runs it, but this package's saved activations) says the plan does not fit")
LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783), Table 4"
# Meta's own 4D-parallel stack: which kernels it runs and what it overlaps is not published; priced as Megatron-LM's
LLAMA3_STACK = replace(MEGATRON_2024, name="Meta's Llama 3 stack (unpublished kernels: as Megatron-LM 2024)")
LLAMA3_WHY = ("the paper's interleaved schedule has V stages per rank and a tunable number of contiguous "
              "micro-batches, neither published: the 126 layers are split as published (one fewer on the first and "
              "last stage: Megatron's embedding and loss accounting, 8 per rank), priced at V = 1, where the 1F1B "
              "bubble alone is (p-1)/(m+p-1) of the step (a third at m = 32), which the paper's (p-1)/(V·m) "
              "removes; at V = 2, 4, 8 the model's step gives 43-50 % MFU but its memory (TE activations, no "
              "recompute) 100-117 GB: the rows cannot be pinned (NVIDIA's Llama 3.1 405B recipe, whose VP 7 is "
              "published, is reached above)")
UNREACHED = [
    (Row("Llama 3.1 8B FSDP (8 H100)", f"{TORCHTITAN_PAGE}, Table 1, row FSDP: 8 GPUs, local batch 2, global 16, "
         "selective AC, 5,762 tokens/s/GPU", "h100-sxm", PUBLISHED_MODELS["llama3-8b"], 8192, 16,
         Plan(1, 1, 1, 1, 8, 2, "selective", False, "fsdp"), TORCHTITAN, {"tokens_per_s": 8 * 5762},
         "sequence 8192: torchtitan's llama3_8b default (5,762 tokens/s is then 34 % MFU, as the page's 33-39 % says)"),
     POWER_CAPPED),
    (Row("Llama 3.1 8B FSDP (128 H100)", f"{TORCHTITAN_PAGE}, Table 3, row FSDP: 128 GPUs, local batch 2, global "
         "256, selective AC, 5,605 tokens/s/GPU", "h100-sxm", PUBLISHED_MODELS["llama3-8b"], 8192, 256,
         Plan(1, 1, 1, 1, 128, 2, "selective", False, "fsdp"), TORCHTITAN, {"tokens_per_s": 128 * 5605},
         "sequence 8192 as Table 1"), POWER_CAPPED),
    (Row("Llama 3 405B (8,192 H100)", f"{LLAMA3}, row 1: TP 8, CP 1, PP 16, DP 64, sequence 8,192, batch/DP 32, "
         "430 TFLOPs/GPU, BF16 MFU 43 %", "h100-sxm", PUBLISHED_MODELS["llama3-405b"], 8192, 64 * 32,
         Plan(8, 1, 16, 1, 64, 1, "none", True, "zero1", split=ACCOUNTED), LLAMA3_STACK, {"mfu": 0.43},
         "no activation checkpointing (§3.3.2); FSDP sharding optimizer states and gradients, parameters kept after "
         "forward: zero1's traffic; micro-batch 1 and V = 1 assumed"), LLAMA3_WHY),
    (Row("Llama 3 405B (16,384 H100)", f"{LLAMA3}, row 2: TP 8, CP 1, PP 16, DP 128, sequence 8,192, batch/DP 16, "
         "400 TFLOPs/GPU, BF16 MFU 41 %", "h100-sxm", PUBLISHED_MODELS["llama3-405b"], 8192, 128 * 16,
         Plan(8, 1, 16, 1, 128, 1, "none", True, "zero1", split=ACCOUNTED), LLAMA3_STACK, {"mfu": 0.41},
         "as row 1"),
     LLAMA3_WHY),
]
# What calibrate() fitted, rounded, lives in the profiles (bench.plan.hardware.CLUSTERS).
A100_GEMM, A100_COMM = CLUSTERS["a100-80g"].gemm_efficiency, CLUSTERS["a100-80g"].comm_efficiency
TRAIN_JSON = os.path.join(RESULTS, "train.json")
ROOT = os.path.dirname(os.path.dirname(RESULTS))  # the repository, which the CPU rows' source is named from


def clusters(a100_gemm=None, a100_comm=None):
    """{hardware: Cluster} of the published rows, the A100's efficiencies replaced where given (calibration)."""
    a100 = replace(CLUSTERS["a100-80g"], gemm_efficiency=a100_gemm or A100_GEMM,
                   comm_efficiency=a100_comm or A100_COMM)
    return {"a100-80g": a100, "h100-sxm": CLUSTERS["h100-sxm"]}


def predict(row, cluster):
    """The model's row for a published run (its pinned plan)."""
    return evaluate(GPTConfig(**row.model), row.plan, seq_len=row.seq_len,
                    global_batch_size=row.global_batch_size, cluster=cluster, software=row.software)


def _figures(row, got, cluster):
    """The modelled figures a source may publish: MFU, HFU (fractions of peak), the job's tokens/s, TFLOP/s per GPU
    (the model FLOPs counted as the row's source counts them)."""
    config = GPTConfig(**row.model)
    scale = flops_per_token(config, row.seq_len, causal_halved=row.causal_halved) / model_flops_per_token(
        config, row.seq_len)
    return {"mfu": got["mfu"] * scale, "hfu": got["hfu"], "tokens_per_s": got["tokens_per_s"],
            "tflops_per_gpu": got["mfu"] * scale * cluster.device.flops / 1e12}


def plan_label(got):
    """A row's plan as the table prints it."""
    label = (f"tp{got['tp']} cp{got['cp']} pp{got['pp']} vp{got['vp']} dp{got['dp']} mbs{got['mbs']} "
             f"{got['recompute']} sp-{got['sp']}" + (f" {got['dp_mode']}" if got['dp'] > 1 else ""))
    label += f" split={got['split']}" if got["split"] != "even" else ""
    return label + (f" ep{got['ep']} etp{got['etp']}" if got["ep"] > 1 else "")


def _compare(row, cluster):
    got = predict(row, cluster)
    figures = _figures(row, got, cluster)
    result = {"row": row.name, "source": row.source, "hardware": row.hardware, "note": row.note,
              "software": row.software.name, "plan": plan_label(got), "memory_gb": got["memory_per_gpu_gb"],
              "fits": got["fits"], "step_s": got["step_s"], "gpus": row.plan.gpus, "ep": got["ep"],
              "etp": got["etp"]}
    for metric, value in row.published.items():
        result[f"published_{metric}"] = value
        result[f"predicted_{metric}"] = figures[metric]
        result[f"error_{metric}"] = figures[metric] / value - 1
    return result


def published_rows(cluster_map=None, rows=None):
    """Each published run (the A100 ones, then the H100 ones): its plan as published, the estimated memory, and
    published vs predicted figures."""
    cluster_map = cluster_map or clusters()
    return [_compare(row, cluster_map[row.hardware]) for row in (PUBLISHED + H100_PUBLISHED if rows is None else rows)]


def unreached_rows():
    """The UNREACHED runs: published vs predicted, and why they miss."""
    return [_compare(row, CLUSTERS[row.hardware]) | {"why": why} for row, why in UNREACHED]


def cpu_op_overhead(path=TRAIN_JSON):
    """The cpu-measured profile's one fitted number: the per-op eager overhead (seconds) with which the model
    reproduces bench.train's 1x1x1 tokens/s (bisection; the other splits are then predictions)."""
    low, high = 0.0, 1e-3
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if cpu_rows(path, op_overhead=mid)[0]["error_tokens_per_s"] > 0 else (low, mid)
    return low


def cpu_rows(path=TRAIN_JSON, op_overhead=None):
    """bench.train's measured tokens/s per split vs the cpu-measured prediction."""
    with open(path) as f:
        measured = json.load(f)
    a = measured["args"]
    config = GPTConfig(**(PRESETS[a["model"]] | {"max_seq_len": a["seq_len"]}))
    cluster = cpu_cluster(op_overhead=cpu_op_overhead(path) if op_overhead is None else op_overhead)
    out = []
    for r in measured["throughput"]:
        sizes = tuple(map(int, r["split"].split("x")))  # TxPxD, or TxCxPxD with context parallelism
        t, c, p, d = sizes if len(sizes) == 4 else (sizes[0], 1, *sizes[1:])
        plan = Plan(t, c, p, 1, d, a["micro_batch_size"], "none", False, "ddp")
        got = step_time(config, plan, seq_len=a["seq_len"], global_batch_size=a["global_batch_size"],
                        cluster=cluster, software=OURS_CPU)
        source = os.path.relpath(path, ROOT)
        out.append({"row": f"models.train {r['split']}", "source": f"{source} (bench.train, {measured['machine']})",
                    "measured_tokens_per_s": r["tokens_per_s"], "predicted_tokens_per_s": got["tokens_per_s"],
                    "error_tokens_per_s": got["tokens_per_s"] / r["tokens_per_s"] - 1, "step_s": got["step_s"]})
    return out


def _errors(rows):
    return [abs(r[k]) for r in rows for k in r if k.startswith("error_") and isinstance(r[k], float)]


def calibrate():
    """The hardware-level numbers: A100 GEMM and collective efficiency minimising the mean |error| over the A100
    rows; the CPU's per-op overhead matching 1x1x1."""
    a100 = [r for r in PUBLISHED if r.hardware == "a100-80g"]
    best = None
    for gemm in [x / 100 for x in range(50, 100)]:
        for comm in [x / 20 for x in range(4, 21)]:
            rows = published_rows(clusters(gemm, comm), a100)
            errors = _errors(rows)
            score = sum(errors) / len(errors)
            if best is None or score < best[0]:
                best = (score, gemm, comm)
    _, a100_gemm, a100_comm = best
    return {"a100_gemm": a100_gemm, "a100_comm": a100_comm, "cpu_op_overhead": cpu_op_overhead()}


TABLE = [("row", "run", "{}"), ("plan", "plan (as published)", "{}"),
         ("memory_gb", "mem GB", "{:.1f}"), ("published_mfu", "MFU pub", "{:.1%}"),
         ("predicted_mfu", "MFU pred", "{:.1%}"), ("error_mfu", "err", "{:+.1%}"),
         ("published_hfu", "HFU pub", "{:.1%}"),
         ("predicted_hfu", "HFU pred", "{:.1%}"), ("error_hfu", "err", "{:+.1%}")]
FIGURE_TABLE = [("row", "run", "{}"), ("plan", "plan (as published)", "{}"), ("memory_gb", "mem GB", "{:.1f}"),
                ("figure", "figure", "{}"), ("published", "published", "{}"), ("predicted", "predicted", "{}"),
                ("error", "err", "{:+.1%}")]
CPU_TABLE = [("row", "run", "{}"), ("measured_tokens_per_s", "measured tokens/s", "{:,.0f}"),
             ("predicted_tokens_per_s", "predicted", "{:,.0f}"), ("error_tokens_per_s", "err", "{:+.1%}")]
FIGURE_FORMAT = {"mfu": ("MFU", "{:.1%}"), "hfu": ("HFU", "{:.1%}"), "tokens_per_s": ("tokens/s/GPU", "{:,.0f}"),
                 "tflops_per_gpu": ("TFLOP/s/GPU", "{:.0f}")}


def figure_lines(rows):
    """One line per published figure of each row (tokens/s shown per GPU), for FIGURE_TABLE."""
    out = []
    for r in rows:
        gpus = r["gpus"]
        for metric, (label, fmt) in FIGURE_FORMAT.items():
            if f"published_{metric}" in r:
                scale = 1 / gpus if metric == "tokens_per_s" else 1
                out.append({"row": r["row"], "plan": r["plan"], "memory_gb": r["memory_gb"], "figure": label,
                            "published": fmt.format(r[f"published_{metric}"] * scale),
                            "predicted": fmt.format(r[f"predicted_{metric}"] * scale), "error": r[f"error_{metric}"]})
    return out


def _summary(rows):
    errors = _errors(rows)
    return (f"|error| over {len(errors)} figures: mean {sum(errors) / len(errors):.1%}, max {max(errors):.1%}; "
            f"within 20 %: {sum(e <= 0.2 for e in errors)} of {len(errors)}")


def validate(*, json_out=False, out=None):
    """`--validate`: print the published and the CPU rows (as JSON with `json_out`); write validation.json into
    `out`."""
    overhead = cpu_op_overhead()
    published, cpu = published_rows(), cpu_rows(op_overhead=overhead)
    unreached = unreached_rows()
    h100 = CLUSTERS["h100-sxm"]
    payload = {"calibrated": {"a100_gemm": A100_GEMM, "a100_comm": A100_COMM, "cpu_op_overhead": overhead},
               "h100": {"gemm": h100.gemm_efficiency, "comm": h100.comm_efficiency,
                        "cudnn_attention": h100.cudnn_attention_efficiency,
                        "flash_attention": h100.attention_efficiency, "source": h100.source},
               "published": published, "unreached": unreached, "cpu": cpu}
    if json_out:
        print(json.dumps(payload, indent=1))
    else:
        a100 = [r for r in published if r["hardware"] == "a100-80g"]
        h100_rows = [r for r in published if r["hardware"] == "h100-sxm"]
        print(f"Published A100 runs (calibrated: A100 GEMMs at {A100_GEMM:.2f} of peak, collectives at "
              f"{A100_COMM:.2f} of the link; nothing per row)")
        print_table(a100, TABLE)
        print(_summary(a100))
        print(f"\nPublished H100 bf16 runs (h100-sxm, measured or published fractions, none fitted: GEMMs at "
              f"{h100.gemm_efficiency:.3f} of peak on full tile-waves, collectives at {h100.comm_efficiency:.2f} of "
              "the link, attention at measured rates by sequence length)")
        print_table(figure_lines(h100_rows), FIGURE_TABLE)
        print(_summary(h100_rows))
        print("\nH100 runs not reached within 20 % (outside the statistics above)")
        print_table(figure_lines(unreached), FIGURE_TABLE)
        for r in unreached:
            print(f"  {r['row']}: {r['why']}")
        print(f"\nThis package on this CPU (cpu-measured profile; per-op overhead {overhead * 1e6:.0f} us "
              "fitted to 1x1x1, the rest predicted)")
        print_table(cpu, CPU_TABLE)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "validation.json"), "w") as f:
            json.dump(payload, f, indent=1)
    return 0
