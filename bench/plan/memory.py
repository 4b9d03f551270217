"""Per-rank memory of a GPTConfig under a tp × cp × pp × dp (× ep × etp) split: the estimate that adds up the
parameters, gradients and optimizer state and the activations of the largest pipeline stage, counted as this
package's code allocates and saves them (or, to price another implementation's run: backend "te", what
Megatron-Core layers on Transformer Engine save, and optimizer_bytes / grad_bytes, its optimizer's state per
parameter: state_memory).

    estimate(config, tp=8, pp=4, dp=16, micro_batch_size=1, seq_len=4096, sequence_parallel=True,
             recompute="selective", dp_mode="zero1", precision="bf16")  -> MemoryEstimate (bytes)

This module holds the estimate: its argument checks, the choice of stage (only the first and the last pipeline rank
can be the largest), what a stage keeps beside its layers (RoPE's cos/sin tables, ZB-H1's deferred W inputs,
full recompute's one recomputed block) and MemoryEstimate. The counts it adds up live beside it, each module's
docstring with its accounting: bench/plan/parameters.py (each parameter's shape on a stage, bytes per parameter for
ddp, zero1 and fsdp, the experts' buckets) and bench/plan/activations.py (what a layer saves per micro-batch, the
tensors outside the layers, micro-batches in flight per schedule). It re-exports their public names.
"""
import itertools
from dataclasses import dataclass

from kernels.ops import BACKENDS as KERNEL_BACKENDS
from models.config import GPTConfig
from models.recompute import GRANULARITIES
from models.training import data_parallel
from tp.pipeline import schedules

from .activations import (
    PRECISIONS,
    edge_activation_bytes,
    in_flight,
    layer_activation_bytes,
    layer_wgrad_bytes,
    local_kv_heads,
    mla_activation_bytes,
    mtp_activation_bytes,
    rope_width,
    split_backward_states,
    zb_states,
)
from .parameters import (
    STEP_BYTES,
    bytes_per_parameter,
    experts_apart,
    layer_parameter_shapes,
    parameter_memory,
    stage_chunks,
    stage_numel,
    stage_parameter_shapes,
    state_memory,
)
from .recompute import parse as parse_recompute
from .recompute import recomputes
from .stages import EVEN, layer_counts

__all__ = ["BACKENDS", "DP_MODES", "PRECISIONS", "RECOMPUTE", "SCHEDULES", "STEP_BYTES", "MemoryEstimate",
           "bytes_per_parameter", "edge_activation_bytes", "estimate", "experts_apart", "in_flight",
           "layer_activation_bytes", "layer_parameter_shapes", "layer_wgrad_bytes", "local_kv_heads",
           "mla_activation_bytes", "mtp_activation_bytes", "parameter_memory", "rope_width", "split_backward_states",
           "stage_chunks", "stage_numel", "stage_parameter_shapes", "state_memory", "zb_states"]

DP_MODES = tuple(data_parallel.MODES)
RECOMPUTE = tuple(GRANULARITIES)
SCHEDULES = tuple(schedules.SCHEDULES)
BACKENDS = (*KERNEL_BACKENDS, "te")  # this package's layers on each kernels backend, or Megatron-Core on TE


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank on the largest stage; `stage` is its pipeline rank."""
    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward × in-flight micro-batches, plus embedding/loss
    transient: int  # full recompute's recomputed block, FSDP's unsharded stage and grads, torch DDP's buckets
    total: int
    stage: int
    in_flight: float  # micro-batches of whole-stage activations alive at once on that stage
    layer_activations: int  # one layer, one micro-batch

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


# ---- the estimate ----------------------------------------------------------------------------------------------------


def _check(config, tp, cp, pp, dp, micro_batch_size, seq_len, sequence_parallel, recompute, dp_mode, precision,
           virtual_stages, schedule, backend, split):
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("micro_batch_size", micro_batch_size),
                        ("seq_len", seq_len), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    parse_recompute(recompute)  # a granularity or recompute modules joined by "+"
    for name, value, allowed in (("dp_mode", dp_mode, DP_MODES),
                                 ("precision", precision, tuple(PRECISIONS)), ("schedule", schedule, SCHEDULES),
                                 ("backend", backend, BACKENDS)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {allowed}")
    config.check_tp(tp)
    if split.even and pp * virtual_stages > config.num_layers:
        raise ValueError(f"pp={pp} x virtual_stages={virtual_stages} stages need at least that many layers, the "
                         f"model has num_layers={config.num_layers}")
    if (virtual_stages > 1) != schedules.SCHEDULES[schedule].interleaves:
        chunked = " or ".join(repr(name) for name, kind in schedules.SCHEDULES.items() if kind.interleaves)
        raise ValueError(f"virtual_stages={virtual_stages} goes with schedule={chunked} (got {schedule!r})")
    layer_counts(config.num_layers, pp, virtual_stages, split)  # ValueError naming what does not divide
    shards = 2 * cp * (tp if sequence_parallel else 1) if cp > 1 else (tp if sequence_parallel else 1)
    if seq_len % shards:
        raise ValueError(f"seq_len={seq_len} is not divisible by {shards} (" + (
            "2·cp" if cp > 1 else "") + ("·tp: sequence parallelism" if sequence_parallel else "") + ")")


def _check_experts(config, tp, cp, dp, ep, etp):
    etp = tp if etp is None else etp
    for name, value in (("ep", ep), ("etp", etp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if (tp * cp * dp) % (ep * etp):
        raise ValueError(f"ep={ep} * etp={etp} = {ep * etp} does not divide tp*cp*dp = {tp}*{cp}*{dp} = "
                         f"{tp * cp * dp}")
    if (ep > 1 or etp != tp) and not config.num_experts:
        raise ValueError(f"ep={ep} etp={etp} split the experts of a mixture of experts, and the model has none")
    if config.num_experts:
        config.check_experts(ep, etp)


def _per_layer(config, **kwargs):
    """layer_activation_bytes of every layer, counted once per kind of layer (dense, MoE): the planner asks often."""
    if not config.num_experts:
        return [layer_activation_bytes(config, **kwargs)] * config.num_layers
    kinds = {}
    for i in range(config.num_layers):
        if config.is_moe_layer(i) not in kinds:
            kinds[config.is_moe_layer(i)] = layer_activation_bytes(config, layer=i, **kwargs)
    return [kinds[config.is_moe_layer(i)] for i in range(config.num_layers)]


def estimate(config, *, tp, cp=1, pp, dp, micro_batch_size, seq_len, sequence_parallel, recompute, dp_mode,
             precision, virtual_stages=1, schedule="1f1b", micro_batches=None, backend="triton", ep=1, etp=None,
             optimizer_bytes=None, grad_bytes=4, split=EVEN, fsdp_reshard=False):
    """Per-rank bytes of the pipeline stage that needs the most (MemoryEstimate). `micro_batches` per step (None:
    at least pp, 1F1B's worst case; GPipe needs it); `backend` "triton" (the fused layers, GPUs), "torch" (CPU
    eager: at tp = 1 autograd's own activation ops) or "te" (Megatron-Core on Transformer Engine:
    bench.plan.activations); `ep`, `etp` (default tp): the experts' split (MoE). `optimizer_bytes` (per parameter,
    sharded over dp·cp under zero1) with `grad_bytes` (per parameter, whole): another implementation's optimizer
    (state_memory); None: tp.optim's layout (parameter_memory). `split`: bench.plan.stages' StageSplit (Megatron's
    uneven first/last stages, embedding and loss accounted); `fsdp_reshard`: FSDP2 resharding each block (torchtitan)
    rather than the pipeline runner's whole unsharded stage."""
    _check(config, tp, cp, pp, dp, micro_batch_size, seq_len, sequence_parallel, recompute, dp_mode, precision,
           virtual_stages, schedule, backend, split)
    if optimizer_bytes is not None and dp_mode == "fsdp":
        raise ValueError(f"optimizer_bytes={optimizer_bytes!r} prices a dp-sharded optimizer (dp_mode 'zero1' or "
                         "'ddp'), not dp_mode='fsdp'")
    _check_experts(config, tp, cp, dp, ep, etp)
    shape = dict(tp=tp, cp=cp, micro_batch_size=micro_batch_size, seq_len=seq_len,
                 sequence_parallel=sequence_parallel, precision=precision)
    layer_bytes = _per_layer(config, recompute=recompute, backend=backend, etp=etp, **shape)
    per_layer = max(layer_bytes)
    prefix = list(itertools.accumulate(layer_bytes, initial=0))  # layers [start, stop) save prefix[stop]-prefix[start]
    full_layer = max(_per_layer(config, recompute="none", backend=backend, etp=etp, **shape))
    e = PRECISIONS[precision]
    # RoPE's cos/sin [s, d], cached across layers (under cp each layer indexes its own: in layer_activation_bytes)
    kept = config.position == "rope" and not recomputes(recompute, "block") and cp == 1
    rope_tables = 2 * e * seq_len * rope_width(config) if kept else 0
    best = None
    # Only the ends can be the largest: pipeline rank 0 holds at least any middle rank's layers (models.stages gives the
    # extra ones to the first stages; with interleaving its chunks are the first of each round), at least as many
    # micro-batches in flight, and the embedding; the last holds the output layer and the loss. An uneven split may
    # give the middle ranks more layers: rank 1 has the most micro-batches in flight of them.
    for stage in sorted({0, pp - 1} | ({min(1, pp - 1)} if not split.even else set())):
        chunks = stage_chunks(config.num_layers, pp, stage, virtual_stages, split)
        layers = sum(stop - start for start, stop, _, _ in chunks)
        saved = sum(prefix[stop] - prefix[start] for start, stop, _, _ in chunks)
        alive = in_flight(schedule, pp, stage, virtual_stages, micro_batches)
        edges = sum(edge_activation_bytes(config, first=first, last=last, backend=backend, **shape)
                    for _, _, first, last in chunks)
        if stage == pp - 1 and config.mtp_num_layers:  # the MTP depths: a block of the last layer's kind each
            saved += config.mtp_num_layers * layer_bytes[-1]
            edges += mtp_activation_bytes(config, backend=backend, **shape)
            layers += config.mtp_num_layers
        activations = int(alive * (saved + edges)) + rope_tables
        # a micro-batch past its B keeps what its W needs until the W (ZB-H1 defers them)
        if schedules.SCHEDULES[schedule].split_backward:
            held = layers * layer_wgrad_bytes(config, **{k: shape[k] for k in ("tp", "cp", "micro_batch_size",
                                                                           "seq_len", "precision")})
            held += sum(e * shape["micro_batch_size"] * seq_len // cp * (config.hidden_size +
                                                                         config.padded_vocab_size(tp) // tp)
                        for _, _, _, last in chunks if last)  # the output layer's input and vocabulary gradient
            activations = max(int(a * (saved + edges)) + w * held
                              for a, w in split_backward_states(schedule, pp, stage, micro_batches or pp)) + rope_tables
        where = dict(tp=tp, pp=pp, stage=stage, virtual_stages=virtual_stages, dp_mode=dp_mode, precision=precision,
                     shards=dp * cp, ep=ep, etp=etp, split=split)
        params, grads, optimizer, transient = \
            parameter_memory(config, fsdp_reshard=fsdp_reshard, **where) if optimizer_bytes is None else \
            state_memory(config, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, **where)
        transient += full_layer if recomputes(recompute, "block") else 0
        total = params + grads + optimizer + activations + transient
        if best is None or total > best.total:
            best = MemoryEstimate(params, grads, optimizer, activations, transient, total, stage, alive, per_layer)
    return best
