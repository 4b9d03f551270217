"""Per-rank memory of a GPTConfig under a tp × cp × pp × dp split: parameters, gradients, optimizer state and
activations of the largest pipeline stage, counted as this package's code allocates and saves them (or, to price
another implementation's run: backend "te", what Megatron-Core layers on Transformer Engine save, and
optimizer_bytes / grad_bytes, its optimizer's state per parameter: state_memory).

    estimate(config, tp=8, pp=4, dp=16, micro_batch_size=1, seq_len=4096, sequence_parallel=True,
             recompute="selective", dp_mode="zero1", precision="bf16")  -> MemoryEstimate (bytes)

Parameters: the exact shapes models.GPT builds on a stage (tests compare them with a real stage): fused QKV with
kv heads replicated when fewer than tp, SwiGLU's fused gate/up, the vocabulary padded to a multiple of
tp·make_vocab_size_divisible_by, norms and row biases whole on every tp rank, a tied output weight counted once where
both ends share a stage. Under cp every rank holds them all. Stages hold the layers and chunks models.stages places:
with v virtual stages rank r holds chunks c·pp + r (Megatron's interleaving).

Bytes per parameter (the mixed-precision table of the ZeRO paper, Rajbhandari et al. 2020 §3.1, as Megatron's
distributed-optimizer doc gives it; d = dp·cp ranks share the optimizer, as Megatron's distributed optimizer shards
over the dp-cp group):
  fp32: params 4, grads 4, Adam moments 8;  bf16: params 2, fp32 main_grad 4, fp32 master 4 + moments 8;
  and AdamW's step counter, 4 bytes per parameter tensor (per piece of one under the distributed optimizer).
  ddp: all of it on every rank (18 B bf16, 16 B fp32; fp32 runs torch DDP, whose bucket copy of the gradients is
  counted as transient; bf16 an unsharded tp.optim.DataParallel per model chunk); zero1: the optimizer state / d
  (6 + 12/d, 8 + 8/d), exactly as tp.optim.DataParallel and DistributedOptimizer lay it out (buckets padded to a
  multiple of d, one DataParallel per model chunk); fsdp: everything / d, each parameter sharded
  on dim 0 as FSDP2 does (ceil(rows / d) rows per rank), its master kept as the sharded fp32 parameter (16/d), plus
  (transient) the whole stage's unsharded compute copy and fp32 gradients: the pipeline runner keeps resharding and
  gradient sync off until the schedule's last backward, as torch.distributed.pipelining does (e + 4 bytes per
  parameter at the end of the backward, whatever the micro-batch count).

Mixtures of experts (ep, etp; etp defaults to tp): an MoE layer holds the router [E, h], E/ep experts F/etp wide
and the shared expert split over tp; when the experts' replicas (edp = tp·cp·dp / (ep·etp) ranks) are not the dense
weights' (ep > 1 or etp != tp), tp.optim.DataParallel keeps them in buckets of their own over edp (sharded over edp by
zero1; the optimizer bytes are the largest rank's sum of its dense and expert shards, paired through tp.mesh.layout)
and FSDP2 shards them over edp; fp32 ddp then runs DataParallel's all-reduce form instead of torch DDP.

Activations per layer and micro-batch (T = b·s/cp tokens on this rank, T' = T/tp under SP, e = 2 bf16 / 4 fp32
bytes, h hidden, a heads, k kv heads (local k' = max(k/tp, 1)), d head dim, f ffn). Korthikanti et al. 2022's
count (arXiv:2205.05198, activation memory per layer) redone for this code: SDPA keeps no s×s scores, SwiGLU, GQA,
RMSNorm's fp32 statistics:
  norm (×2)  RMSNorm: input in fp32 (4·T'h: it upcasts), rstd 4·T', normed and weighted output e·2·T'h;
             LayerNorm: input and output e·2·T'h, mean and rstd 8·T'
  attention  fused qkv e·T(a/tp + 2k')d, roped q,k e·T(a/tp + k')d (RoPE only: else views of qkv), output
             e·T·a/tp·d, log-sum-exp 4·T·a/tp
             (selective recompute drops the lse only: with SDPA there are no scores to drop)
  mlp        pre-activation e·T·(2)f/tp, output e·T·f/tp; at tp = 1 on the torch backend without main_grad,
             autograd's own SwiGLU keeps an fp32 pre-activation and silu(gate) instead (4·3T·f + e·T·f)
  dropout    p > 0: a 1-byte mask per residual dropout (2·T'h)
  cp > 1     the same tensors on s/cp tokens (ring and all-gather attention keep q, k, v, output and lse of this
             rank's share), plus cos/sin gathered at its positions per layer (2·e·s/cp·d)
  full recompute: the block input only, e·T'h (plus one block recomputed at a time: `transient`)
Per micro-batch and stage: token ids (8 B) and the embedding's mask; on the last stage the final norm, the loss's
fp32 softmax over this rank's real vocabulary columns, targets and masks; on other stages the output kept for the
backward send (e·T'h, not a saved tensor but held by the runner). RoPE's cos/sin tables once per stage.
In flight (micro-batches whose activations are alive at once, stage i of p): 1F1B and ZB-H1 min(p − i, m), GPipe m,
interleaved (p − i − 1)·2 + (v − 1)·p + 1 chunks of 1/v stage each (Megatron's warm-up; rank 0: p + (p − 1)/v);
each equal to tp.pipeline.schedules' simulated peak (tests). ZB-H1 also keeps, from a micro-batch's B to its W, every
linear's input and output gradient (layer_wgrad_bytes; the last stage's output layer its vocabulary gradient too),
and its ranks hold W's back: the peak over the schedule's actions of awaiting-B micro-batches × their activations +
awaiting-W ones × that (the last of p ranks: up to p W's, against 1F1B's one micro-batch there).

The activation counts described above are computed in bench/plan/activations.py; this module adds the rest
and the estimate.
"""
import math
from dataclasses import dataclass
from types import SimpleNamespace

from models.config import GPTConfig
from models.stages import stage_options
from tp.mesh import layout

from .activations import (
    PRECISIONS,
    edge_activation_bytes,
    in_flight,
    layer_activation_bytes,
    layer_wgrad_bytes,
    local_kv_heads,
    zb_states,
)

DP_MODES = ("ddp", "zero1", "fsdp")
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
BACKENDS = ("triton", "torch", "te")
STEP_BYTES = 4  # torch.optim.AdamW's per-tensor step counter (a float32 scalar tensor)
_CACHE = {}  # memoized stage parameter counts and bytes (the planner asks for the same stages often)


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


# ---- parameters ----------------------------------------------------------------------------------------------------


def experts_apart(config, tp, ep=1, etp=None):
    """Whether the experts' replicas (edp) are not the dense weights' (dp·cp): their buckets are then their own."""
    return bool(config.num_experts) and (ep > 1 or (tp if etp is None else etp) != tp)


def layer_parameter_shapes(config, tp, layer=0, *, ep=1, etp=None):
    """[(name, shape)] of TransformerBlock `layer` on a tp rank, as models.block builds it; an MoE layer's MLP is
    tp.moe.MoE's: the router [E, h] whole, E/ep experts sliced F/etp wide (fc1 [E/ep, (2)F/etp, h], fc2 [E/ep, h,
    F/etp], registered `mlp.experts.*`), the shared expert tp-split like the dense MLP (its gate [1, h] whole)."""
    h, d, ffn = config.hidden_size, config.head_dim, config.ffn_hidden_size
    qkv_rows = (config.num_heads // tp + 2 * local_kv_heads(config, tp)) * d
    fc1_rows = (2 if config.activation == "swiglu" else 1) * ffn // tp
    def norm(name):
        return [(f"{name}.weight", (h,))] + ([(f"{name}.bias", (h,))] if config.norm == "layernorm" else [])

    shapes = norm("norm1") + [("attention.qkv.weight", (qkv_rows, h))]
    if config.bias or config.qkv_bias:
        shapes.append(("attention.qkv.bias", (qkv_rows,)))
    shapes.append(("attention.proj.weight", (h, config.num_heads * d // tp)))
    shapes += [("attention.proj.bias", (h,))] if config.bias else []
    shapes += norm("norm2")
    if config.is_moe_layer(layer):
        return shapes + _moe_shapes(config, tp, ep, tp if etp is None else etp)
    shapes += [("mlp.fc1.weight", (fc1_rows, h))]
    shapes += [("mlp.fc1.bias", (fc1_rows,))] if config.bias else []
    shapes.append(("mlp.fc2.weight", (h, ffn // tp)))
    shapes += [("mlp.fc2.bias", (h,))] if config.bias else []
    return shapes


def _moe_shapes(config, tp, ep, etp):
    h, experts, f, shared = config.hidden_size, config.num_experts, config.moe_ffn_hidden_size, \
        config.moe_shared_expert_size
    glu = 2 if config.activation == "swiglu" else 1
    shapes = [("mlp.router.weight", (experts, h)), ("mlp.experts.fc1", (experts // ep, glu * f // etp, h)),
              ("mlp.experts.fc2", (experts // ep, h, f // etp))]
    if shared:
        shapes += [("mlp.shared.gate", (1, h))] if config.moe_shared_expert_gate else []
        shapes += [("mlp.shared.fc1.weight", (glu * shared // tp, h)), ("mlp.shared.fc2.weight", (h, shared // tp))]
    return shapes


def _is_expert(name):
    return ".experts." in f".{name}"


def stage_chunks(num_layers, pp, stage, virtual_stages=1):
    """[(first layer, stop, pre_process, post_process)] of the model chunks pipeline rank `stage` holds, as
    models.stages.stage_options places them on a mesh (it reads only the model's num_layers and the mesh's pp size and
    rank)."""
    model, mesh = SimpleNamespace(num_layers=num_layers), SimpleNamespace(pp_size=pp, pp_rank=stage)
    chunks = (stage_options(model, mesh, c, virtual_stages) for c in range(virtual_stages))
    return [(*options["layers"], options["pre_process"], options["post_process"]) for options in chunks]


def _edge_shapes(config, tp, first):
    """[(name, shape)] of a chunk's embeddings (none unless it is the first)."""
    h, padded = config.hidden_size, config.padded_vocab_size(tp)
    shapes = []
    if first:
        shapes.append(("embedding.weight", (padded // tp, h)))
        if config.position == "learned":
            shapes.append(("position_embedding.weight", (config.max_seq_len, h)))
    return shapes


def _head_shapes(config, tp, first):
    h, padded = config.hidden_size, config.padded_vocab_size(tp)
    shapes = [("final_norm.weight", (h,))] + ([("final_norm.bias", (h,))] if config.norm == "layernorm" else [])
    if not (config.tie_embeddings and first):  # tied on one stage: the embedding's own parameter
        shapes.append(("output.weight", (padded // tp, h)))
    return shapes


def stage_parameter_shapes(config, tp, pp=1, stage=0, virtual_stages=1, *, ep=1, etp=None):
    """[(name, shape)] of every parameter pipeline rank `stage` holds on one tp rank (a tied weight once)."""
    shapes = []
    for c, (start, stop, first, last) in enumerate(stage_chunks(config.num_layers, pp, stage, virtual_stages)):
        prefix = f"chunk{c}." if virtual_stages > 1 else ""
        shapes += [(prefix + name, shape) for name, shape in _edge_shapes(config, tp, first)]
        for i in range(start, stop):
            shapes += [(f"{prefix}layers.{i - start}.{name}", shape)
                       for name, shape in layer_parameter_shapes(config, tp, i, ep=ep, etp=etp)]
        shapes += [(prefix + name, shape) for name, shape in _head_shapes(config, tp, first)] if last else []
    return shapes


def bytes_per_parameter(precision, dp_mode, shards=1):
    """(params, grads, optimizer) bytes per parameter on one rank; `shards` ranks share what the mode shards."""
    e = PRECISIONS[precision]
    master = 4 if precision == "bf16" else 0
    if dp_mode == "fsdp":  # FSDP2 keeps the fp32 sharded parameter (it is the master) and sharded fp32 grads
        return 4 / shards, 4 / shards, 8 / shards
    optimizer = (master + 8) / (shards if dp_mode == "zero1" else 1)
    return e, 4, optimizer


def _sharded_numel(shape, shards):
    """Elements FSDP2 allocates per rank for one parameter: dim 0 padded to a multiple of the shards."""
    return -(-shape[0] // shards) * math.prod(shape[1:])


def _registration(config, tp, chunks, ep=1, etp=None):
    """[(numel, alone, expert)] of a stage's parameters in registration order; `alone`: a tied embedding/output
    weight, which tp.optim.DataParallel reduces in a bucket of its own; `expert`: an expert weight (tp.moe's)."""
    items = []
    for start, stop, first, last in chunks:
        items += [(math.prod(s), config.tie_embeddings and name == "embedding.weight", False)
                  for name, s in _edge_shapes(config, tp, first)]
        for i in range(start, stop):
            items += [(math.prod(s), False, _is_expert(name))
                      for name, s in layer_parameter_shapes(config, tp, i, ep=ep, etp=etp)]
        if last:
            items += [(math.prod(s), config.tie_embeddings and name == "output.weight", False)
                      for name, s in _head_shapes(config, tp, first)]
    return items


def stage_numel(config, tp, pp=1, stage=0, virtual_stages=1, *, ep=1, etp=None):
    """Parameters pipeline rank `stage` holds on one tp rank (a tied weight once). Memoized."""
    chunks = stage_chunks(config.num_layers, pp, stage, virtual_stages)
    return _memoized(("numel", repr(config), tp, pp, stage, virtual_stages, ep, etp),
                     lambda: sum(n for n, *_ in _registration(config, tp, chunks, ep, etp)))


def _memoized(key, compute):
    if key not in _CACHE:
        if len(_CACHE) > 100_000:  # bounded: a long-lived process sweeping many models
            _CACHE.clear()
        _CACHE[key] = compute()
    return _CACHE[key]


def _bucket_bytes(items, shards, *, shard, precision, bucket_numel=None):
    """(params, grads, [optimizer bytes per dp rank]) under tp.optim.DataParallel (+ DistributedOptimizer when
    `shard`): buckets of max(4e7, 1e6·dp) parameters in reverse registration order, each padded to a multiple of the
    dp size when sharded; fp32 gradients; fp32 masters (a copy under bf16) and AdamW's moments over this rank's
    shard, one step counter per parameter piece in it. `bucket_numel`: the dense group's (for the experts' buckets)."""
    bucket_numel = bucket_numel or max(40_000_000, 1_000_000 * shards)
    groups, current = [], []
    for numel, alone, *_ in reversed(items):
        if alone:
            groups.append([numel])
            continue
        current.append(numel)
        if sum(current) >= bucket_numel:
            groups, current = groups + [current], []
    groups += [current] if current else []
    padded_total, per_rank = 0, [0] * (shards if shard else 1)
    for group in groups:
        numel = sum(group)
        size = -(-numel // shards) * shards if shard else numel
        padded_total += size
        n = size // shards if shard else size
        offsets = [0]
        for x in group:
            offsets.append(offsets[-1] + x)
        for r in range(len(per_rank)):
            lo, hi = r * n, min((r + 1) * n, numel)
            real = max(0, hi - lo)
            pieces = sum(1 for i in range(len(group)) if offsets[i] < hi and offsets[i + 1] > lo)
            masters = 4 * n if precision == "bf16" else 0  # a copy of the shard (padding included) under bf16
            per_rank[r] += masters + 8 * real + STEP_BYTES * pieces
    return PRECISIONS[precision] * padded_total, 4 * padded_total, per_rank


def _rank_pairs(tp, shards, ep, etp):
    """[(dp·cp rank, edp rank)] of every rank of one stage (tp.mesh.layout's groups): which dense shard and which
    expert shard each rank holds. Memoized."""
    def pairs():
        table = layout(tp * shards, tp=tp, dp=shards, ep=ep, etp=etp)
        dense = {r: g.index(r) for g in table["dp-cp"] for r in g}
        return sorted({(dense[r], g.index(r)) for g in table["edp"] for r in g})
    return _memoized(("pairs", tp, shards, ep, etp), pairs)


def parameter_memory(config, *, tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep=1, etp=None):
    """(params, grads, optimizer, transient) bytes of pipeline rank `stage` under the training job's data
    parallelism: fp32 "ddp" is torch DDP (+ its bucket copy of the gradients, transient) and AdamW; bf16, "zero1"
    and experts apart from the dense weights (ep > 1 or etp != tp), tp.optim.DataParallel (+ DistributedOptimizer;
    the experts in buckets of their own over edp = tp·shards / (ep·etp)); "fsdp" FSDP2 (each parameter's dim 0
    split over the ranks, the experts' over edp) and AdamW. `shards`: dp·cp. The optimizer bytes are the largest
    rank's. Memoized: the planner asks for the same stages many times."""
    return _memoized((repr(config), tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep, etp),
                     lambda: _parameter_memory(config, tp, pp, stage, virtual_stages, dp_mode, precision, shards,
                                               ep, etp))


def _parameter_memory(config, tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep, etp):
    chunks = stage_chunks(config.num_layers, pp, stage, virtual_stages)
    items = _registration(config, tp, chunks, ep, etp)
    named = stage_parameter_shapes(config, tp, pp, stage, virtual_stages, ep=ep, etp=etp)
    shapes, experts = [s for _, s in named], [_is_expert(n) for n, _ in named]
    apart = experts_apart(config, tp, ep, etp)
    edp = tp * shards // (ep * (tp if etp is None else etp)) if apart else shards
    if dp_mode == "fsdp":
        local = sum(_sharded_numel(s, edp if x else shards) for s, x in zip(shapes, experts))
        # the runner keeps resharding and gradient sync off until the schedule's last backward (as torch's
        # pipelining does): the whole stage's unsharded compute copy and fp32 gradients are alive at its end
        transient = (PRECISIONS[precision] + 4) * sum(n for n, *_ in items)
        return 4 * local, 4 * local, 8 * local + STEP_BYTES * len(shapes), transient
    if dp_mode == "zero1" or precision == "bf16" or apart:  # one DataParallel per model chunk (models.training)
        shard, params, grads = dp_mode == "zero1", 0, 0
        dense, expert = [0] * (shards if shard else 1), [0] * (edp if shard else 1)
        for chunk in chunks:
            chunk_items = _registration(config, tp, [chunk], ep, etp)
            for kind, per_rank, n in ((False, dense, shards), (True, expert, edp)):
                kind_items = [i for i in chunk_items if apart and i[2] == kind or not apart and not kind]
                if kind_items:
                    p, g, o = _bucket_bytes(kind_items, n, shard=shard, precision=precision,
                                            bucket_numel=max(40_000_000, 1_000_000 * shards))
                    params, grads, per_rank[:] = params + p, grads + g, [a + b for a, b in zip(per_rank, o)]
        if not (apart and shard):
            return params, grads, max(dense) + max(expert), 0
        return params, grads, max(dense[i] + expert[j] for i, j in _rank_pairs(tp, shards, ep, etp)), 0
    n = sum(math.prod(s) for s in shapes)
    ddp_buckets = 4 * n if shards > 1 else 0  # torch DDP reduces through its own copy of the gradients
    return 4 * n, 4 * n, 8 * n + STEP_BYTES * len(shapes), ddp_buckets


def state_memory(config, *, tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep=1, etp=None,
                 grad_bytes, optimizer_bytes):
    """(params, grads, optimizer, 0) bytes of pipeline rank `stage` under another implementation's data-parallel
    optimizer, per parameter: e for the parameter, `grad_bytes` for its gradient buffer (whole), `optimizer_bytes`
    of state sharded over the dp·cp ranks (the experts' over edp) under zero1, whole under ddp. Megatron-LM's
    compute_weight_and_optimizer_memory (megatron/training/theoretical_memory_usage.py) counts Megatron-Core's
    distributed optimizer so: 6 + 12/dp (bf16 parameter, fp32 gradient, fp32 master and Adam moments)."""
    chunks = stage_chunks(config.num_layers, pp, stage, virtual_stages)
    items = _registration(config, tp, chunks, ep, etp)
    n = sum(numel for numel, *_ in items)
    expert = sum(numel for numel, _, is_expert in items if is_expert) if experts_apart(config, tp, ep, etp) else 0
    edp = tp * shards // (ep * (tp if etp is None else etp))
    if dp_mode == "zero1":
        state = optimizer_bytes * (-(-(n - expert) // shards) + -(-expert // edp))
    else:
        state = optimizer_bytes * n
    return PRECISIONS[precision] * n, grad_bytes * n, int(state), 0


# ---- the estimate ----------------------------------------------------------------------------------------------------


def _check(config, tp, cp, pp, dp, micro_batch_size, seq_len, sequence_parallel, recompute, dp_mode, precision,
           virtual_stages, schedule, backend):
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp), ("micro_batch_size", micro_batch_size),
                        ("seq_len", seq_len), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    for name, value, allowed in (("recompute", recompute, RECOMPUTE), ("dp_mode", dp_mode, DP_MODES),
                                 ("precision", precision, tuple(PRECISIONS)), ("schedule", schedule, SCHEDULES),
                                 ("backend", backend, BACKENDS)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {allowed}")
    config.check_tp(tp)
    if pp * virtual_stages > config.num_layers:
        raise ValueError(f"pp={pp} x virtual_stages={virtual_stages} stages need at least that many layers, the "
                         f"model has num_layers={config.num_layers}")
    if (virtual_stages > 1) != (schedule == "interleaved"):
        raise ValueError(f"virtual_stages={virtual_stages} goes with schedule='interleaved' (got {schedule!r})")
    if virtual_stages > 1 and config.num_layers % (pp * virtual_stages):
        raise ValueError(f"num_layers={config.num_layers} is not divisible by pp*virtual_stages = {pp}*"
                         f"{virtual_stages} (interleaved chunks hold equal numbers of layers)")
    split = 2 * cp * (tp if sequence_parallel else 1) if cp > 1 else (tp if sequence_parallel else 1)
    if seq_len % split:
        raise ValueError(f"seq_len={seq_len} is not divisible by {split} (" + (
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
             optimizer_bytes=None, grad_bytes=4):
    """Per-rank bytes of the pipeline stage that needs the most (MemoryEstimate). `micro_batches` per step (None:
    at least pp, 1F1B's worst case; GPipe needs it); `backend` "triton" (the fused layers, GPUs), "torch" (CPU
    eager: at tp = 1 autograd's own activation ops) or "te" (Megatron-Core on Transformer Engine:
    bench.plan.activations); `ep`, `etp` (default tp): the experts' split (MoE). `optimizer_bytes` (per parameter,
    sharded over dp·cp under zero1) with `grad_bytes` (per parameter, whole): another implementation's optimizer
    (state_memory); None: tp.optim's layout (parameter_memory)."""
    _check(config, tp, cp, pp, dp, micro_batch_size, seq_len, sequence_parallel, recompute, dp_mode, precision,
           virtual_stages, schedule, backend)
    if optimizer_bytes is not None and dp_mode == "fsdp":
        raise ValueError(f"optimizer_bytes={optimizer_bytes!r} prices a dp-sharded optimizer (dp_mode 'zero1' or "
                         "'ddp'), not dp_mode='fsdp'")
    _check_experts(config, tp, cp, dp, ep, etp)
    shape = dict(tp=tp, cp=cp, micro_batch_size=micro_batch_size, seq_len=seq_len,
                 sequence_parallel=sequence_parallel, precision=precision)
    layer_bytes = _per_layer(config, recompute=recompute, backend=backend, etp=etp, **shape)
    per_layer = max(layer_bytes)
    full_layer = max(_per_layer(config, recompute="none", backend=backend, etp=etp, **shape))
    e = PRECISIONS[precision]
    # RoPE's cos/sin [s, d], cached across layers (under cp each layer indexes its own: in layer_activation_bytes)
    rope_tables = 2 * e * seq_len * config.head_dim if config.position == "rope" and recompute != "full" and \
        cp == 1 else 0
    best = None
    # Only the ends can be the largest: pipeline rank 0 holds at least any middle rank's layers (models.stages gives the
    # extra ones to the first stages; with interleaving its chunks are the first of each round), at least as many
    # micro-batches in flight, and the embedding; the last holds the output layer and the loss.
    for stage in sorted({0, pp - 1}):
        chunks = stage_chunks(config.num_layers, pp, stage, virtual_stages)
        layers = sum(stop - start for start, stop, _, _ in chunks)
        saved = sum(layer_bytes[i] for start, stop, _, _ in chunks for i in range(start, stop))
        alive = in_flight(schedule, pp, stage, virtual_stages, micro_batches)
        edges = sum(edge_activation_bytes(config, first=first, last=last, backend=backend, **shape)
                    for _, _, first, last in chunks)
        activations = int(alive * (saved + edges)) + rope_tables
        if schedule == "zb":  # a micro-batch past its B keeps what its W needs until the W (ZB-H1 defers them)
            held = layers * layer_wgrad_bytes(config, **{k: shape[k] for k in ("tp", "cp", "micro_batch_size",
                                                                           "seq_len", "precision")})
            held += sum(e * shape["micro_batch_size"] * seq_len // cp * (config.hidden_size +
                                                                         config.padded_vocab_size(tp) // tp)
                        for _, _, _, last in chunks if last)  # the output layer's input and vocabulary gradient
            activations = max(int(a * (saved + edges)) + w * held
                              for a, w in zb_states(pp, stage, micro_batches or pp)) + rope_tables
        split = dict(tp=tp, pp=pp, stage=stage, virtual_stages=virtual_stages, dp_mode=dp_mode, precision=precision,
                     shards=dp * cp, ep=ep, etp=etp)
        params, grads, optimizer, transient = parameter_memory(config, **split) if optimizer_bytes is None else \
            state_memory(config, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, **split)
        transient += full_layer if recompute == "full" else 0
        total = params + grads + optimizer + activations + transient
        if best is None or total > best.total:
            best = MemoryEstimate(params, grads, optimizer, activations, transient, total, stage, alive, per_layer)
    return best
