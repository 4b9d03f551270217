"""Parameters, gradients and optimizer states per rank of a pipeline stage (bench.plan.memory's other half): each
parameter's shape on a tp rank as models.block and tp.moe build it, the stage's registration order, and the bytes the
training job's data parallelism (tp.optim.DataParallel / DistributedOptimizer buckets, torch DDP, FSDP2) or another
implementation's optimizer keeps per rank.

Parameters: the exact shapes models.GPT builds on a stage (tests compare them with a real stage): fused QKV with
kv heads replicated when fewer than tp, SwiGLU's fused gate/up, the vocabulary padded to a multiple of
tp·make_vocab_size_divisible_by, norms and row biases whole on every tp rank, a tied output weight counted once where
both ends share a stage; multi-head latent attention's down-projections and latent norms whole on every tp rank,
its up-projections over the rank's heads (models.mla); the MTP depths (models.mtp) and, on a last stage without the
embedding, the copy of it they read, after the output layer. Under cp every rank holds them all. Stages hold the
layers and chunks models.stages places: with v virtual stages rank r holds chunks c·pp + r (Megatron's
interleaving).

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
"""
import math

from tp.mesh import layout

from .activations import PRECISIONS, local_kv_heads
from .stages import EVEN, stage_chunks

STEP_BYTES = 4  # torch.optim.AdamW's per-tensor step counter (a float32 scalar tensor)
_CACHE = {}  # memoized stage parameter counts and bytes (the planner asks for the same stages often)


def experts_apart(config, tp, ep=1, etp=None):
    """Whether the experts' replicas (edp) are not the dense weights' (dp·cp): their buckets are then their own."""
    return bool(config.num_experts) and (ep > 1 or (tp if etp is None else etp) != tp)


def expert_replicas(tp, shards, ep=1, etp=None):
    """edp: the ranks of one stage holding the same expert slice, of its tp·shards (shards: dp·cp)."""
    return tp * shards // (ep * (tp if etp is None else etp))


def layer_parameter_shapes(config, tp, layer=0, *, ep=1, etp=None):
    """[(name, shape)] of TransformerBlock `layer` on a tp rank, as models.block builds it; an MoE layer's MLP is
    tp.moe.MoE's: the router [E, h] whole, E/ep experts sliced F/etp wide (fc1 [E/ep, (2)F/etp, h], fc2 [E/ep, h,
    F/etp], registered `mlp.experts.*`), the shared expert tp-split like the dense MLP (its gate [1, h] whole)."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    fc1_rows = (2 if config.activation == "swiglu" else 1) * ffn // tp
    shapes = _norm_shapes(config, "norm1") + _attention_shapes(config, tp) + _norm_shapes(config, "norm2")
    if config.is_moe_layer(layer):
        return shapes + _moe_shapes(config, tp, ep, tp if etp is None else etp)
    shapes += [("mlp.fc1.weight", (fc1_rows, h))]
    shapes += [("mlp.fc1.bias", (fc1_rows,))] if config.bias else []
    shapes.append(("mlp.fc2.weight", (h, ffn // tp)))
    shapes += [("mlp.fc2.bias", (h,))] if config.bias else []
    return shapes


def _norm_shapes(config, name):
    h = config.hidden_size
    return [(f"{name}.weight", (h,))] + ([(f"{name}.bias", (h,))] if config.norm == "layernorm" else [])


def _attention_shapes(config, tp):
    """[(name, shape)] of a block's attention on a tp rank: GQA's fused QKV and output projection (models.block), or
    multi-head latent attention's (models.mla): the down-projections and latent RMSNorms whole on every rank, the
    up-projections column-parallel over heads, the output projection row-parallel."""
    c, h = config, config.hidden_size
    if c.multi_latent_attention:
        heads = c.num_heads // tp
        if c.q_lora_rank is None:
            shapes = [("attention.q.weight", (heads * c.qk_head_dim, h))]
        else:
            shapes = [("attention.q_down.weight", (c.q_lora_rank, h)), ("attention.q_latent_norm.weight",
                      (c.q_lora_rank,)), ("attention.q_up.weight", (heads * c.qk_head_dim, c.q_lora_rank))]
        return shapes + [("attention.kv_down.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h)),
                         ("attention.kv_latent_norm.weight", (c.kv_lora_rank,)),
                         ("attention.kv_up.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)),
                         ("attention.proj.weight", (h, heads * c.v_head_dim))]
    d = c.head_dim
    qkv_rows = (c.num_heads // tp + 2 * local_kv_heads(c, tp)) * d
    shapes = [("attention.qkv.weight", (qkv_rows, h))]
    shapes += [("attention.qkv.bias", (qkv_rows,))] if c.bias or c.qkv_bias else []
    shapes.append(("attention.proj.weight", (h, c.num_heads * d // tp)))
    return shapes + ([("attention.proj.bias", (h,))] if c.bias else [])


def _mtp_shapes(config, tp, ep, etp):
    """[(name, shape)] of the multi-token prediction depths (models.mtp) on the last stage, each a [2h → h]
    projection whole on every tp rank between two norms, a block of the last layer's kind and its own final norm."""
    shapes = []
    for k in range(config.mtp_num_layers):
        block = [(f"block.{name}", s) for name, s in layer_parameter_shapes(config, tp, config.num_layers - 1,
                                                                            ep=ep, etp=etp)]
        depth = _norm_shapes(config, "embedding_norm") + _norm_shapes(config, "hidden_norm") + \
            [("proj.weight", (config.hidden_size, 2 * config.hidden_size))] + block + _norm_shapes(config, "final_norm")
        shapes += [(f"mtp.{k}.{name}", s) for name, s in depth]
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


def _edge_shapes(config, tp, first):
    """[(name, shape)] of a chunk's embeddings (none unless it is the first)."""
    h, padded = config.hidden_size, config.padded_vocab_size(tp)
    shapes = []
    if first:
        shapes.append(("embedding.weight", (padded // tp, h)))
        if config.position == "learned":
            shapes.append(("position_embedding.weight", (config.max_seq_len, h)))
    return shapes


def _head_shapes(config, tp, first, ep=1, etp=None):
    """[(name, shape)] of the last chunk's head: final norm, output layer and the MTP depths, with the copy of the
    embedding they read on a last stage without it (models.gpt)."""
    h, padded = config.hidden_size, config.padded_vocab_size(tp)
    shapes = _norm_shapes(config, "final_norm")
    if not (config.tie_embeddings and first):  # tied on one stage: the embedding's own parameter
        shapes.append(("output.weight", (padded // tp, h)))
    if config.mtp_num_layers and not first and not config.tie_embeddings:
        shapes.append(("embedding.weight", (padded // tp, h)))
    return shapes + _mtp_shapes(config, tp, ep, etp)


def stage_parameter_shapes(config, tp, pp=1, stage=0, virtual_stages=1, *, ep=1, etp=None, split=EVEN):
    """[(name, shape)] of every parameter pipeline rank `stage` holds on one tp rank (a tied weight once); `split`:
    bench.plan.stages' (even by default)."""
    shapes = []
    for c, (start, stop, first, last) in enumerate(stage_chunks(config.num_layers, pp, stage, virtual_stages, split)):
        prefix = f"chunk{c}." if virtual_stages > 1 else ""
        shapes += [(prefix + name, shape) for name, shape in _edge_shapes(config, tp, first)]
        for i in range(start, stop):
            shapes += [(f"{prefix}layers.{i - start}.{name}", shape)
                       for name, shape in layer_parameter_shapes(config, tp, i, ep=ep, etp=etp)]
        shapes += [(prefix + name, shape) for name, shape in _head_shapes(config, tp, first, ep, etp)] if last else []
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
            items += [(math.prod(s), config.tie_embeddings and name == "output.weight", _is_expert(name))
                      for name, s in _head_shapes(config, tp, first, ep, etp)]
    return items


def stage_numel(config, tp, pp=1, stage=0, virtual_stages=1, *, ep=1, etp=None, split=EVEN):
    """Parameters pipeline rank `stage` holds on one tp rank (a tied weight once). Memoized."""
    chunks = stage_chunks(config.num_layers, pp, stage, virtual_stages, split)
    return _memoized(("numel", repr(config), tp, pp, stage, virtual_stages, ep, etp, split),
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


def parameter_memory(config, *, tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep=1, etp=None,
                     split=EVEN, fsdp_reshard=False):
    """(params, grads, optimizer, transient) bytes of pipeline rank `stage` under the training job's data
    parallelism: fp32 "ddp" is torch DDP (+ its bucket copy of the gradients, transient) and AdamW; bf16, "zero1"
    and experts apart from the dense weights (ep > 1 or etp != tp), tp.optim.DataParallel (+ DistributedOptimizer;
    the experts in buckets of their own over edp = tp·shards / (ep·etp)); "fsdp" FSDP2 (each parameter's dim 0
    split over the ranks, the experts' over edp) and AdamW. `shards`: dp·cp. The optimizer bytes are the largest
    rank's. Memoized: the planner asks for the same stages many times."""
    return _memoized((repr(config), tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep, etp, split,
                      fsdp_reshard),
                     lambda: _parameter_memory(config, tp, pp, stage, virtual_stages, dp_mode, precision, shards,
                                               ep, etp, split, fsdp_reshard))


def _parameter_memory(config, tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep, etp, split,
                      fsdp_reshard):
    chunks = stage_chunks(config.num_layers, pp, stage, virtual_stages, split)
    items = _registration(config, tp, chunks, ep, etp)
    named = stage_parameter_shapes(config, tp, pp, stage, virtual_stages, ep=ep, etp=etp, split=split)
    shapes, experts = [s for _, s in named], [_is_expert(n) for n, _ in named]
    apart = experts_apart(config, tp, ep, etp)
    edp = expert_replicas(tp, shards, ep, etp) if apart else shards
    if dp_mode == "fsdp":
        local = sum(_sharded_numel(s, edp if x else shards) for s, x in zip(shapes, experts))
        e = PRECISIONS[precision]
        if fsdp_reshard:  # each block gathered for its forward and backward, the next one prefetched
            return 4 * local, 4 * local, 8 * local + STEP_BYTES * len(shapes), _resharded_peak(config, tp, chunks,
                                                                                              ep, etp, e)
        # the runner keeps resharding and gradient sync off until the schedule's last backward (as torch's
        # pipelining does): the whole stage's unsharded compute copy and fp32 gradients are alive at its end
        transient = (e + 4) * sum(n for n, *_ in items)
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


def _resharded_peak(config, tp, chunks, ep, etp, e):
    """FSDP2 resharding after forward and backward (torchtitan; fully_shard per block, then the stage), its peak as a
    CPU run measures it (tests/test_memory.py), at a block's backward: the stage's own parameters (embedding, final
    norm, output layer: the root unit, gathered for the whole step) and their gradients but the embedding's (it comes
    last), and the block's unsharded parameters and gradients in the compute dtype, plus under bf16 the fp32 copy
    of its gradients the reduce-scatter takes (FSDP2 gathers the next block only once this one's backward is done)."""
    blocks = [sum(math.prod(s) for _, s in layer_parameter_shapes(config, tp, i, ep=ep, etp=etp))
              for start, stop, _, _ in chunks for i in range(start, stop)]
    root = sum(n for n, *_ in _registration(config, tp, chunks, ep, etp)) - sum(blocks)
    late = sum(math.prod(s) for first in (c[2] for c in chunks) if first for name, s in _edge_shapes(config, tp, True)
               if not (config.tie_embeddings and any(c[3] for c in chunks)))
    largest = max(blocks, default=0)
    return e * (2 * root - late) + 2 * e * largest + (4 * largest if e != 4 else 0)


def state_memory(config, *, tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep=1, etp=None,
                 grad_bytes, optimizer_bytes, split=EVEN):
    """(params, grads, optimizer, 0) bytes of pipeline rank `stage` under another implementation's data-parallel
    optimizer, per parameter: e for the parameter, `grad_bytes` for its gradient buffer (whole), `optimizer_bytes`
    of state sharded over the dp·cp ranks (the experts' over edp) under zero1, whole under ddp. Megatron-LM's
    compute_weight_and_optimizer_memory (megatron/training/theoretical_memory_usage.py) counts Megatron-Core's
    distributed optimizer so: 6 + 12/dp (bf16 parameter, fp32 gradient, fp32 master and Adam moments). Memoized."""
    def compute():
        items = _registration(config, tp, stage_chunks(config.num_layers, pp, stage, virtual_stages, split), ep, etp)
        n = sum(numel for numel, *_ in items)
        apart = experts_apart(config, tp, ep, etp)
        expert = sum(numel for numel, _, is_expert in items if is_expert) if apart else 0
        if dp_mode == "zero1":
            state = optimizer_bytes * (-(-(n - expert) // shards) + -(-expert // expert_replicas(tp, shards, ep, etp)))
        else:
            state = optimizer_bytes * n
        return PRECISIONS[precision] * n, grad_bytes * n, int(state), 0
    return _memoized(("state", repr(config), tp, pp, stage, virtual_stages, dp_mode, precision, shards, ep, etp,
                      grad_bytes, optimizer_bytes, split), compute)
