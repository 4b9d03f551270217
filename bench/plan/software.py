"""How the trained code runs (Software): the facts of an implementation the step time and the memory depend on — its
attention kernel, element-wise kernels, what it overlaps, its optimizer's bytes, how its MoE layer launches kernels,
whether FSDP2 reshards — never fitted. SOFTWARE is the registry `python -m bench.plan --software` chooses from:
this package ("ours"), Megatron-Core on Transformer Engine, NVIDIA's NeMo recipes, torchtitan. The validation's
published rows use the dated presets below them (each run's own stack).
"""
from dataclasses import dataclass, replace

from tp.moe import DISPATCHERS

from .moe_time import DEEPEP


@dataclass(frozen=True)
class Software:
    """How the trained code runs: facts of an implementation (not fitted)."""
    name: str
    precision: str = "bf16"
    attention: str = "flash"  # "flash" (SDPA, no s×s in memory) | "materialized" (scores, softmax, dropout in HBM)
    elementwise: str = "eager"  # "eager" (separate torch ops) | "fused" (Megatron's fused kernels)
    grad_bytes: int = 4  # per gradient element reduced over dp (fp32 main_grad; Megatron's fp16 runs and
    # --grad-reduce-in-bf16: 2)
    dp_overlap: bool = True  # the gradient reduce overlaps the last micro-batch's backward (bucketed)
    p2p_scatter_gather: bool = False  # Megatron: each tp rank sends 1/tp of the activation between stages
    backend: str = "triton"  # bench.plan.memory's: "torch" on CPU (autograd's own ops at tp = 1), "te" (Megatron-Core
    # on Transformer Engine: what its layers save, bench.plan.activations)
    optimizer_bytes: float | None = None  # optimizer state per parameter sharded over dp·cp, with a grad_bytes
    # gradient buffer (bench.plan.memory.state_memory); None: tp.optim's layout (fp32 master and Adam moments, 12 B
    # under bf16: Megatron-Core's distributed optimizer's too)
    tp_overlap: bool = False  # TE userbuffers (--tp-comm-overlap): tp collectives pipelined with their GEMMs
    param_gather_overlap: bool = False  # --overlap-param-gather: zero1's parameter all-gather behind the forward
    p2p_overlap: bool = False  # --overlap-p2p-comm (interleaved): stage sends behind another chunk's compute
    optimizer: str = "tp.optim (fp32 master and Adam moments, fp32 main_grad)"  # what its optimizer keeps, in words
    dispatchers: tuple = tuple(DISPATCHERS)  # the MoE token dispatchers it implements (bench.plan.moe_time.CHOICES)
    # kernels one MoE layer's forward launches from its host sync on: (fixed, per local expert) (bench.plan.moe_time)
    moe_launches: tuple = (26, 0)
    ep_overlap: bool = False  # the dispatch/combine hidden behind another micro-batch's compute
    bf16_grad_reduce: bool = False  # may reduce gradients in bf16 (--fix grad_reduce=bf16)
    fsdp_reshard: bool = False  # FSDP2 reshards each block after its forward and backward (else: the pipeline
    # runner keeps the whole stage unsharded until the last backward)
    lacks_dp_modes: tuple = ()  # dp modes (models.training.data_parallel.MODES' names) it does not run

    def describe(self):
        """Its name, what it overlaps and its optimizer, in one line (the CLI's header)."""
        overlaps = [name for name, on in (("tp-comm", self.tp_overlap), ("grad reduce", self.dp_overlap),
                                          ("param gather", self.param_gather_overlap), ("p2p", self.p2p_overlap),
                                          ("ep dispatch", self.ep_overlap)) if on]
        return f"{self.name}: overlaps {', '.join(overlaps) or 'nothing'}; optimizer {self.optimizer}"


# This package: SDPA flash attention, eager element-wise ops, tp.optim's buckets; its MoE layer's forward launches
# 22 kernels from the dispatch on (counted with a TorchDispatchMode on tp.moe at ep 1: tests/test_moe_plan.py) plus
# the count table's gather and host copy and the two all-to-alls, one grouped GEMM for all local experts.
OURS = Software("tp-layers")
OURS_CPU = Software("tp-layers on CPU", precision="fp32", backend="torch")
MEGATRON_2021 = Software("Megatron-LM 2021-22", precision="fp16", attention="materialized", elementwise="fused",
                         grad_bytes=2, dp_overlap=False, p2p_scatter_gather=True,
                         optimizer="fp32 master and Adam moments, fp16 gradients")
# NVIDIA's 2024 H100 recipes (NeMo on Megatron-Core + Transformer Engine): cuDNN fused attention, fused element-wise
# kernels, the distributed optimizer with --overlap-grad-reduce and --overlap-param-gather, TE's tp-comm overlap and
# overlapped p2p (NeMo-Framework-Launcher's llama3_1_70b.yaml: ub_tp_comm_overlap, overlap_grad_sync,
# overlap_param_sync, overlap_p2p_comm all true); activations as Transformer Engine's layers save them. MoE:
# Transformer Engine's GroupedLinear launches one GEMM per local expert (fc1 and fc2: 2 per expert forward); with
# --moe-permute-fusion and --moe-router-fusion the rest of the layer from the dispatch on is ~12 kernels (the
# permutation, the count and token all-to-alls, the chunk sort and unsort, the activation, the combine all-to-all,
# the unpermutation, the probabilities' scaling).
NEMO_2024 = Software("NeMo 24.x / Megatron-Core (TE)", attention="cudnn", elementwise="fused", dp_overlap=True,
                     tp_overlap=True, param_gather_overlap=True, p2p_overlap=True, backend="te",
                     optimizer="Megatron-Core distributed optimizer (fp32 master and moments, fp32 gradients)",
                     dispatchers=(*DISPATCHERS, DEEPEP), moe_launches=(12, 2), bf16_grad_reduce=True,
                     lacks_dp_modes=("fsdp",))  # (Megatron-FSDP is not priced)
# Megatron-LM's own 2024 runs (Nemotron-4 15B): the distributed optimizer with its overlaps; the paper does not say
# that tp communication was overlapped, so it is not
MEGATRON_2024 = replace(NEMO_2024, name="Megatron-LM 2024 (TE)", tp_overlap=False)
# torchtitan (Dec 2024): eager PyTorch ops, SDPA's flash kernel (FlashAttention-2), FSDP2 resharding each block after
# its forward and backward and prefetching the next one's all-gather; its MoE (torch._grouped_mm, one kernel for all
# experts) launches as this package's
TORCHTITAN = Software("torchtitan eager (FSDP2, SDPA)", optimizer="AdamW on FSDP2's fp32 shards",
                      dispatchers=tuple(DISPATCHERS)[:1], bf16_grad_reduce=True, fsdp_reshard=True,
                      lacks_dp_modes=("zero1",))  # (its dispatch: all-to-all)
# Megatron-Core as its MoE model zoo runs it (Megatron-MoE-ModelZoo's model configs: --use-distributed-optimizer,
# --overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap, Transformer Engine, flash attention through TE)
# --use-distributed-optimizer: fp32 master and Adam moments (12 bytes) sharded, a gradient buffer in the reduce's dtype
MEGATRON_CORE = replace(NEMO_2024, name="Megatron-Core (TE)", optimizer_bytes=12)
# NeMo's launcher recipes: Apex's distributed_fused_adam, fp32 moments and the bf16 parameters' 16-bit remainders
# (10 bytes) sharded (bench/plan/validation.py cites the configs)
NEMO = replace(NEMO_2024, optimizer_bytes=10,
               optimizer="distributed_fused_adam (fp32 moments and master remainders, fp32 gradients)")

# --software: name -> Software (the CPU profile runs this package in fp32: OURS_CPU)
SOFTWARE = {"ours": OURS, "megatron-core": MEGATRON_CORE, "nemo": NEMO, "torchtitan": TORCHTITAN}
