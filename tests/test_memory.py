"""bench.plan.memory against this package's own allocations: the parameter shapes of real GPT stages, the bytes of
parameters, gradients and AdamW state after a training step, and the activations autograd saves in a GPT stage
(saved_tensors_hooks, as bench.gpt counts them) within 5 % at tiny sizes for tp / SP / recompute / precision / pipeline
edges; the closed forms (bytes per parameter, in-flight micro-batches) against hand-computed cases."""
import math

import pytest
import torch
import torch.distributed as dist

import models
import tp
import tp.optim
from bench.plan import memory
from models.block import TransformerBlock
from models.config import PUBLISHED_MODELS
from tp.testing import distributed

# kv heads 2 of 8: replicated at tp = 4 (GQA); vocab 300 padded per tp; ffn 80 splits over 1, 2, 4.
TINY = dict(vocab_size=300, hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=2, ffn_hidden_size=80,
            max_seq_len=64)
VARIANTS = {
    "llama": {},
    "gpt2": dict(activation="gelu", norm="layernorm", bias=True, position="learned", tie_embeddings=True,
                 num_kv_heads=8),
    "qwen": dict(qkv_bias=True, num_kv_heads=1, tie_embeddings=True),
}


def config(variant="llama", **changes):
    return models.GPTConfig(**(TINY | VARIANTS[variant] | changes))


# ---- closed forms --------------------------------------------------------------------------------------------------


def test_bytes_per_parameter_by_hand():
    """REFERENCE §11 (Megatron's distributed-optimizer table): 18 vs 6 + 12/d for bf16, 16 vs 8 + 8/d for fp32."""
    assert sum(memory.bytes_per_parameter("bf16", "ddp")) == 18
    assert sum(memory.bytes_per_parameter("bf16", "zero1", 8)) == 6 + 12 / 8
    assert sum(memory.bytes_per_parameter("fp32", "ddp")) == 16
    assert sum(memory.bytes_per_parameter("fp32", "zero1", 4)) == 8 + 8 / 4
    assert sum(memory.bytes_per_parameter("bf16", "fsdp", 16)) == 16 / 16  # fp32 sharded master, grads, moments


def test_te_layer_is_korthikantis_34_sbh_over_t():
    """Korthikanti et al. 2022 (arXiv:2205.05198) §4.2.2, Table 2 (tp + SP): a GPT-3 layer (LayerNorm, 4h GELU MLP,
    MHA, dropout) saves sbh·(34 + 5as/h)/t bytes, 34·sbh/t without the s×s scores (flash / cuDNN attention). The
    Transformer Engine count equals it plus what the paper leaves out, the fp32 statistics: the two LayerNorms'
    mean and rstd (2·8·sb/t) and the attention's log-sum-exp (4·sb·a/t, dropped by selective recompute) — 0.1 % here.
    Megatron-LM's theoretical_memory_usage.py's sbh·(18 + 4·ffn/h)/t for another ffn."""
    s, b, t = 2048, 2, 8
    gpt3 = PUBLISHED_MODELS["gpt3-175b"] | dict(dropout=0.1)
    h, a = gpt3["hidden_size"], gpt3["num_heads"]
    shape = dict(tp=t, micro_batch_size=b, seq_len=s, sequence_parallel=True, precision="bf16", backend="te")
    for ffn in (4 * h, 3 * h):
        cfg = models.GPTConfig(**gpt3, ffn_hidden_size=ffn)
        paper = (18 + 4 * ffn // h) * s * b * h // t
        for recompute, lse in (("none", 4 * s * b * a // t), ("selective", 0)):
            got = memory.layer_activation_bytes(cfg, recompute=recompute, **shape)
            assert got == paper + 2 * 8 * s * b // t + lse, (ffn, recompute)
            assert 0 < got / paper - 1 < 0.01
    assert paper == 30 * s * b * h // t and (18 + 4 * 4) == 34


def test_te_drops_what_this_package_saves_beyond_it():
    """Against this package's count (RMSNorm, RoPE, SwiGLU, GQA): TE keeps no fp32 copy of each norm's input (4·T'h
    per norm), no rotated q and k (e·T·(a/tp + k')·d) and under cp no per-layer cos/sin (2e·s/cp·d)."""
    cfg = config("llama")
    for tp_size, cp in ((1, 1), (2, 1), (4, 2)):
        sp = tp_size > 1
        shape = dict(tp=tp_size, cp=cp, micro_batch_size=2, seq_len=64, sequence_parallel=sp, recompute="none",
                     precision="bf16")
        tokens = 2 * 64 // cp
        rows = tokens // tp_size if sp else tokens
        heads, kv = cfg.num_heads // tp_size, memory.local_kv_heads(cfg, tp_size)
        extra = 2 * 4 * rows * cfg.hidden_size + 2 * tokens * (heads + kv) * cfg.head_dim
        extra += 2 * 2 * 64 // cp * cfg.head_dim if cp > 1 else 0
        ours, te = (memory.layer_activation_bytes(cfg, backend=backend, **shape) for backend in ("triton", "te"))
        assert ours - te == extra, (tp_size, cp)


def test_another_optimizers_bytes_per_parameter():
    """estimate(optimizer_bytes=, grad_bytes=): the parameter in e bytes, a whole gradient buffer of grad_bytes and
    optimizer_bytes of state sharded over dp·cp: Megatron-Core's distributed optimizer 6 + 12/d (Megatron-LM's
    compute_weight_and_optimizer_memory), NeMo's distributed_fused_adam 6 + 10/d (fp32 moments, 16-bit master
    remainders) or, in bf16, 4 + 4/d."""
    cfg = models.GPTConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4)
    args = dict(tp=2, pp=4, dp=4, cp=2, micro_batch_size=1, seq_len=1024, sequence_parallel=True, recompute="none",
                dp_mode="zero1", precision="bf16", backend="te")
    n = memory.stage_numel(cfg, 2, 4, 0)
    for grad_bytes, optimizer_bytes in ((4, 12), (4, 10), (2, 4)):
        est = memory.estimate(cfg, **args, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
        assert (est.params, est.grads, est.optimizer, est.stage) == (2 * n, grad_bytes * n,
                                                                      optimizer_bytes * -(-n // 8), 0)
    ddp = memory.estimate(cfg, **(args | dict(dp_mode="ddp")), optimizer_bytes=12)
    assert ddp.params + ddp.grads + ddp.optimizer == 18 * n
    with pytest.raises(ValueError, match="optimizer_bytes=12 prices a dp-sharded optimizer"):
        memory.estimate(cfg, **(args | dict(dp_mode="fsdp")), optimizer_bytes=12)


def test_in_flight_micro_batches_by_hand():
    # 1F1B: stage i of p keeps p - i (fewer when m < p); GPipe all m
    assert [memory.in_flight("1f1b", 4, i) for i in range(4)] == [4, 3, 2, 1]
    assert memory.in_flight("1f1b", 4, 0, micro_batches=2) == 2
    assert memory.in_flight("gpipe", 4, 3, micro_batches=8) == 8
    with pytest.raises(ValueError, match="give micro_batches"):
        memory.in_flight("gpipe", 4, 0)
    # interleaved, rank 0: (p-1)·2 + (V-1)·p + 1 chunks of 1/V = p + (p-1)/V (Korthikanti's 1 + (p-1)/(pV) factor)
    assert memory.in_flight("interleaved", 4, 0, virtual_stages=2) == (3 * 2 + 4 + 1) / 2 == 4 * (1 + 3 / 8)
    assert memory.in_flight("interleaved", 4, 3, virtual_stages=2) == (0 + 4 + 1) / 2


def test_in_flight_equals_the_schedule_simulators_peaks():
    """The closed forms against tp.pipeline.schedules (the runner's action lists): every rank's peak of forward chunks
    awaiting their backward, for GPipe, 1F1B, ZB-H1 and interleaved over a grid of (p, m, V)."""
    from tp.pipeline import schedules

    for p in (2, 3, 4):
        for m in (1, p, 2 * p, 3 * p + 1):
            for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("zb", (1,)), ("interleaved", (2, 3))):
                for v in vs:
                    if name == "interleaved" and (m < p or m % p):
                        continue
                    peaks = schedules.simulate(schedules.build(name, p, m, v)).peaks
                    closed = [memory.in_flight(name, p, r, v, micro_batches=m) for r in range(p)]
                    assert closed == pytest.approx(peaks), (name, p, m, v, closed, peaks)


def test_stage_chunks_follow_the_pipeline_split():
    # 7 layers on 3 stages: 3, 2, 2 (models.stages.stage_layers); interleaved 2 x 3 virtual stages of 12 layers:
    # rank r holds virtual stages r and 3 + r, two layers each
    assert memory.stage_chunks(7, 3, 0) == [(0, 3, True, False)]
    assert memory.stage_chunks(7, 3, 2) == [(5, 7, False, True)]
    assert memory.stage_chunks(12, 3, 0, 2) == [(0, 2, True, False), (6, 8, False, False)]
    assert memory.stage_chunks(12, 3, 2, 2) == [(4, 6, False, False), (10, 12, False, True)]


def test_dense_model_counts_by_hand():
    """One layer of a GPT-2-shaped model, tp = 1: 12h² + 13h parameters (Narayanan et al. 2021, eq. 2's per-layer
    count: QKV 3h² + 3h, proj h² + h, fc1 4h² + 4h, fc2 4h² + h, two LayerNorms 4h)."""
    h = 64
    c = models.GPTConfig(vocab_size=256, hidden_size=h, num_layers=1, num_heads=4, activation="gelu", norm="layernorm",
                         bias=True, position="learned")
    per_layer = sum(math.prod(s) for _, s in memory.layer_parameter_shapes(c, 1))
    assert per_layer == 12 * h * h + 13 * h


def test_bad_requests_name_the_value():
    c = config()
    args = dict(tp=1, pp=1, dp=1, micro_batch_size=1, seq_len=16, sequence_parallel=False, recompute="none",
                dp_mode="ddp", precision="bf16")
    for changes, message in ((dict(tp=4, seq_len=18, sequence_parallel=True), "seq_len=18"),
                             (dict(tp=3), "num_heads=8 is not divisible by tp=3"),
                             (dict(recompute="some"), "recompute='some'"), (dict(dp_mode="zero3"), "dp_mode='zero3'"),
                             (dict(virtual_stages=2), "virtual_stages=2 goes with schedule='interleaved'"),
                             (dict(pp=4), "num_layers=3"), (dict(dp=0), "dp=0")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            memory.estimate(c, **(args | changes))
    with pytest.raises(ValueError, match=r"num_layers=6 is not divisible by pp\*virtual_stages = 2\*2"):
        memory.estimate(config(num_layers=6), **(args | dict(pp=2, virtual_stages=2, schedule="interleaved")))


# ---- against real stages --------------------------------------------------------------------------------------------


def _stage(cfg, pp, stage, mesh):
    start, stop = models.stages.stage_layers(cfg.num_layers, pp, stage)
    return models.GPT(cfg, group=mesh.tp_group, layers=(start, stop), pre_process=stage == 0,
                      post_process=stage == pp - 1)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_parameters_grads_and_adamw_state_are_what_a_stage_allocates(tp_size):
    """Every stage's parameter shapes equal the estimate's list; after a step of the training job's AdamW (two
    groups, as models.training.trainer builds it) params, grads and optimizer state are the estimate's bytes exactly."""
    mesh = tp.init_mesh(tp=tp_size)
    for variant in VARIANTS:
        cfg = config(variant)
        for pp in (1, 2, 3):
            for stage in range(pp):
                model = _stage(cfg, pp, stage, mesh)
                expected = memory.stage_parameter_shapes(cfg, tp_size, pp, stage)
                assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == expected, (variant, pp, stage)
        model = _stage(cfg, 1, 0, mesh)
        x = torch.randint(0, cfg.vocab_size, (2, 8))
        model(x, x).backward()
        params = list(model.parameters())
        opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                                 {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}])
        opt.step()
        state = sum(t.nbytes for s in opt.state.values() for t in s.values())
        got = (sum(p.nbytes for p in params), sum(p.grad.nbytes for p in params), state)
        want = memory.parameter_memory(cfg, tp=tp_size, pp=1, stage=0, virtual_stages=1, dp_mode="ddp",
                                       precision="fp32", shards=1)[:3]
        assert got == want, (variant, got, want)


def _saved_bytes(model, step):
    """{"layers": [bytes per TransformerBlock], "edges": bytes outside them} of the distinct storages autograd saves
    while step() runs (parameters excluded), as large as they are when it returns (a discarded output's storage is
    freed by then: tp.recompute): bench.gpt's count, attributed to blocks."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    blocks = {id(m): i for i, m in enumerate(m for m in model.modules() if isinstance(m, TransformerBlock))}
    where, saved = ["edges"], {}  # storage -> where autograd first saved it

    def enter(module, args):
        where.append(blocks.get(id(module), where[-1]))

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved.setdefault(storage._cdata, (storage, where[-1]))
        return t

    def leave(module, args, output):
        where.pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = step()
    finally:
        for hook in hooks:
            hook.remove()
    totals = {"edges": 0, **dict.fromkeys(blocks.values(), 0)}
    for storage, owner in saved.values():
        totals[owner] += storage.nbytes()
    out.float().sum().backward()
    return {"layers": [totals[i] for i in sorted(blocks.values())], "edges": totals["edges"]}


def _check_saved(cfg, mesh, *, pp, stage, precision, batch, seq, cp=1):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = _stage(cfg, pp, stage, mesh).to(dtype)
    if precision == "bf16" and mesh.tp_size == 1:  # bf16 training keeps fp32 main_grad buffers (REFERENCE §11);
        for p in model.parameters():  # at tp > 1 the layers save the same either way
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    first, last = stage == 0, stage == pp - 1
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    rows = seq // cp // (mesh.tp_size if cfg.sequence_parallel else 1)
    hidden = None if first else torch.randn(rows, batch, cfg.hidden_size, dtype=dtype, requires_grad=True)
    saved = _saved_bytes(model, lambda: model(tokens if first else None, tokens if last else None, hidden=hidden))
    shape = dict(tp=mesh.tp_size, cp=cp, micro_batch_size=batch, seq_len=seq,
                 sequence_parallel=cfg.sequence_parallel, precision=precision)
    per_layer = memory.layer_activation_bytes(cfg, recompute=cfg.recompute, backend="torch", **shape)
    rope = 2 * memory.PRECISIONS[precision] * seq * cfg.head_dim if cfg.position == "rope" and \
        cfg.recompute != "full" and cp == 1 else 0
    layers = sum(saved["layers"])
    want = len(saved["layers"]) * per_layer + rope
    label = (mesh.tp_size, cfg.sequence_parallel, cfg.recompute, precision, pp, stage, cfg.activation)
    assert abs(layers - want) <= 0.05 * want, (label, layers, want, saved["layers"])
    # edges, on tp rank 0 (it holds the most real vocabulary columns: the estimate's rank); the stage output a
    # non-last stage holds for its send is not a saved tensor (it is in the estimate)
    edges = memory.edge_activation_bytes(cfg, first=first, last=last, **shape)
    if not last:
        edges -= memory.PRECISIONS[precision] * rows * batch * cfg.hidden_size
    if mesh.tp_rank == 0:
        assert abs(saved["edges"] - edges) <= 0.05 * max(edges, 1) + 16, (label, saved["edges"], edges)
    return layers, want


@distributed(world_size=4)
def test_saved_activations_within_5_percent_of_the_estimate():
    """tp 1, 2, 4 x SP off/on x recompute none/selective/full x fp32/bf16, GQA with replicated kv heads at tp 4,
    SwiGLU and GELU; a 3-stage pipeline's first, middle and last stage (embedding, output held, loss); cp 2 and 4
    with ring and all-gather attention, with tp, SP and recompute."""
    for tp_size in (1, 2, 4):
        mesh = tp.init_mesh(tp=tp_size)
        for sp in (False, True) if tp_size > 1 else (False,):
            for recompute in ("none", "selective", "full"):
                for precision in ("fp32", "bf16"):
                    cfg = config(sequence_parallel=sp, recompute=recompute)
                    _check_saved(cfg, mesh, pp=1, stage=0, precision=precision, batch=3, seq=16)
        gelu = config("gpt2", sequence_parallel=tp_size > 1)
        _check_saved(gelu, mesh, pp=1, stage=0, precision="fp32", batch=2, seq=16)
        for stage in range(3):
            _check_saved(config(), mesh, pp=3, stage=stage, precision="bf16", batch=2, seq=16)
        tp.destroy_mesh()
    # context parallelism: ring and all-gather attention (tp.context_parallel_attention) on s/cp tokens per rank
    for tp_size, cp, mode, sp, recompute, precision in ((1, 2, "ring", False, "none", "fp32"),
                                                        (2, 2, "ring", True, "none", "bf16"),
                                                        (1, 2, "allgather", False, "none", "fp32"),
                                                        (1, 4, "ring", False, "selective", "fp32"),
                                                        (2, 2, "allgather", True, "full", "bf16")):
        mesh = tp.init_mesh(tp=tp_size, cp=cp)
        cfg = config(sequence_parallel=sp, recompute=recompute, cp_mode=mode)
        _check_saved(cfg, mesh, pp=1, stage=0, precision=precision, batch=2, seq=16, cp=cp)
        tp.destroy_mesh()


@distributed(world_size=2)
def test_moe_layer_activations_within_5_percent_of_the_estimate():
    """A dense and an MoE layer (dropless, top-2 of 8 experts, ep 1) at tp 1, tp 2 and tp 2 with SP: the tensors
    autograd saves equal the estimate within 5 % (the routed slots at tp = ep = 1 are exactly tokens·k; at tp 2
    without SP each rank routes a scattered copy of its half and the norm's output is not saved)."""
    for tp_size, sp in ((1, False), (2, False), (2, True)):
        mesh = tp.init_mesh(tp=tp_size)
        cfg = config(num_layers=2, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[0, 1],
                     sequence_parallel=sp)
        torch.manual_seed(0)
        model = _stage(cfg, 1, 0, mesh)
        tokens = torch.randint(0, cfg.vocab_size, (3, 16))
        saved = _saved_bytes(model, lambda: model(tokens, tokens))["layers"]
        shape = dict(tp=tp_size, micro_batch_size=3, seq_len=16, sequence_parallel=sp, precision="fp32")
        want = [memory.layer_activation_bytes(cfg, recompute="none", backend="torch", layer=i, **shape)
                for i in range(2)]
        for got, w in zip(saved, want):
            assert abs(got - w) <= 0.05 * w, (tp_size, sp, saved, want)
        tp.destroy_mesh()


MODULE_SETS = (("core_attn",), ("mlp",), ("layernorm",), ("layernorm", "mlp", "core_attn"))
MOE_MODULE_SETS = (("moe",), ("moe_act",), ("shared_experts",), ("layernorm",), ("layernorm", "moe"),
                   ("moe_act", "shared_experts", "layernorm", "core_attn"))


def _module_bytes(cfg, mesh, precision, modules, batch=3, seq=16):
    """(per-block bytes saved, the estimate's) of a one-stage model recomputing `modules` (selective)."""
    cfg = cfg.replace(recompute="selective" if modules else "none", recompute_modules=modules or ("core_attn",))
    torch.manual_seed(0)
    model = _stage(cfg, 1, 0, mesh).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    if precision == "bf16":  # (the job's bf16 keeps fp32 main_grad buffers)
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    saved = _saved_bytes(model, lambda: model(tokens, tokens))["layers"]
    shape = dict(tp=mesh.tp_size, micro_batch_size=batch, seq_len=seq, sequence_parallel=cfg.sequence_parallel,
                 precision=precision)
    want = [memory.layer_activation_bytes(cfg, recompute=cfg.recompute, recompute_modules=modules, backend="torch",
                                          layer=i, **shape) for i in range(cfg.num_layers)]
    want[0] += 2 * memory.PRECISIONS[precision] * seq * cfg.head_dim if cfg.position == "rope" else 0  # cos/sin
    return saved, want


@distributed(world_size=2)
def test_recompute_modules_save_the_estimates_bytes():
    """--recompute-modules (Megatron-Core's names) in dense blocks: the bytes autograd keeps after forward equal the
    estimate byte for byte, at tp 1 and 2 (SP off and on), RMSNorm/SwiGLU in fp32 and bf16, LayerNorm/GELU in fp32
    (in bf16 the CPU's layer_norm keeps its statistics in bf16, a GPU's in fp32 as counted); the output-discarding
    layernorm keeps each norm's input only (its output, the next linear's saved input, freed)."""
    for tp_size, sp in ((1, False), (2, False), (2, True)):
        mesh = tp.init_mesh(tp=tp_size)
        for variant, precisions in (("llama", ("fp32", "bf16")), ("gpt2", ("fp32",))):
            for precision in precisions:
                for modules in (None, *MODULE_SETS):
                    saved, want = _module_bytes(config(variant, sequence_parallel=sp), mesh, precision, modules)
                    assert saved == want, (tp_size, sp, variant, precision, modules, saved, want)
        tp.destroy_mesh()


@distributed(world_size=2)
def test_moe_recompute_modules_drop_the_estimates_bytes():
    """moe, moe_act, shared_experts and layernorm in an MoE layer (top-2 of 8 experts, a shared expert): what each
    set of modules drops from the MoE layer's saved bytes is the estimate's, byte for byte, at tp 1 (bf16) and tp 2
    with and without SP (beside the estimate, the grouped GEMMs keep their per-expert counts, at most 8·(E + 1)
    bytes: dropped with the whole layer under moe); the dense layer before it is exact."""
    moe = dict(num_layers=2, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[0, 1],
               moe_shared_expert_size=32)
    for tp_size, sp, precision in ((1, False, "bf16"), (2, False, "fp32"), (2, True, "fp32")):
        mesh = tp.init_mesh(tp=tp_size)
        cfg = config(sequence_parallel=sp, **moe)
        plain, plain_want = _module_bytes(cfg, mesh, precision, None)
        counts = plain[1] - plain_want[1]
        assert 0 < counts <= 8 * (cfg.num_experts + 1), (plain, plain_want)
        for modules in MOE_MODULE_SETS:
            saved, want = _module_bytes(cfg, mesh, precision, modules)
            assert saved[0] == want[0], (tp_size, sp, modules, saved, want)
            assert saved[1] - want[1] == (0 if "moe" in modules else counts), (tp_size, sp, modules, saved, want)
        tp.destroy_mesh()


@distributed(world_size=1)
def test_recompute_methods_keep_each_groups_input():
    """--recompute full with --recompute-method uniform / block and --recompute-num-layers N on a 5-layer stage: the
    stage keeps each recomputed group's input (models.recompute.recompute_groups) and every other block's whole
    activations, byte for byte (RoPE's cos/sin once, when some block is not recomputed)."""
    from models.recompute import recompute_groups

    mesh = tp.init_mesh()
    shape = dict(tp=1, micro_batch_size=3, seq_len=16, sequence_parallel=False, precision="fp32")
    for method, n in (("uniform", 1), ("uniform", 2), ("uniform", 5), ("block", 2), ("block", 9)):
        cfg = config(num_layers=5, recompute="full", recompute_method=method, recompute_num_layers=n)
        model = _stage(cfg, 1, 0, mesh)
        tokens = torch.randint(0, cfg.vocab_size, (3, 16))
        saved = _saved_bytes(model, lambda: model(tokens, tokens))
        groups = recompute_groups(5, method, n)
        recomputed = {i for group in groups for i in group}
        full, none = (memory.layer_activation_bytes(cfg, recompute=r, backend="torch", **shape)
                      for r in ("full", "none"))
        rope = 2 * 4 * 16 * cfg.head_dim if len(recomputed) < 5 else 0
        want = len(groups) * full + (5 - len(recomputed)) * none + rope
        edges = memory.edge_activation_bytes(cfg, first=True, last=True, **shape)
        assert sum(saved["layers"]) + saved["edges"] - edges == want, (method, n, saved, want)
    tp.destroy_mesh()


def test_estimate_picks_the_largest_stage_and_sums_its_parts():
    cfg = models.GPTConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4)
    args = dict(tp=2, pp=4, dp=4, micro_batch_size=1, seq_len=1024, sequence_parallel=True, recompute="selective",
                dp_mode="zero1", precision="bf16")
    est = memory.estimate(cfg, **args)
    assert est.total == est.params + est.grads + est.optimizer + est.activations + est.transient
    assert est.stage == 0 and est.in_flight == 4  # 1F1B: stage 0 holds p micro-batches
    # by hand: 2 layers x 4 in flight x per layer, plus 4 x (ids + mask + the stage output held), plus cos/sin
    per_layer = memory.layer_activation_bytes(cfg, tp=2, micro_batch_size=1, seq_len=1024, sequence_parallel=True,
                                              recompute="selective", precision="bf16")
    edges = 8 * 1024 + 1024 + 2 * 512 * 1024
    assert est.activations == 4 * (2 * per_layer + edges) + 2 * 2 * 1024 * cfg.head_dim
    # zero1 shards the fp32 master + moments over dp x cp; ddp keeps them whole
    ddp = memory.estimate(cfg, **(args | dict(dp_mode="ddp")))
    n, tensors = ddp.params // 2, len(memory.stage_parameter_shapes(cfg, 2, 4, 0))
    assert n % 4 == 0 and ddp.optimizer == 12 * n + 4 * tensors  # fp32 master, two moments, step counters
    assert 0 < est.optimizer - 12 * n // 4 <= 4 * tensors  # a quarter of them, the counters of this rank's pieces
    assert memory.estimate(cfg, **(args | dict(cp=2))).optimizer < est.optimizer  # dp x cp ranks share it
    # interleaved (2 x 2 chunks): the last rank holds (V-1)·p + 1 = 3 chunks of 1/V stage, each micro-batch with
    # the loss's fp32 softmax over 16000 vocabulary columns: the largest stage here
    inter = memory.estimate(cfg, **(args | dict(pp=2, virtual_stages=2, schedule="interleaved")))
    assert (inter.stage, inter.in_flight) == (1, 1.5)
    # full recompute keeps only block inputs, and recomputes one block at a time
    full = memory.estimate(cfg, **(args | dict(recompute="full")))
    assert full.layer_activations == 2 * 512 * 1024 and full.transient > 0


def _max_over_ranks(values):
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(t.tolist())


@pytest.mark.parametrize("tp_size", [1, 2])
@distributed(world_size=4)
def test_data_parallel_bytes_are_what_tp_optim_and_fsdp2_allocate(tp_size):
    """tp.optim.DataParallel (+ DistributedOptimizer) in bf16 and fp32, sharded (zero1) and not, and FSDP2, over the
    4 / tp data-parallel ranks: tp.optim.memory_bytes after one AdamW step, the largest rank's, equals the estimate
    exactly (buckets padded to the dp size, fp32 masters under bf16, one step counter per parameter piece)."""
    from torch.distributed.fsdp import fully_shard

    mesh = tp.init_mesh(tp=tp_size, dp=4 // tp_size)
    for variant in ("llama", "qwen"):
        cfg = config(variant, vocab_size=301)  # 301: an odd parameter count, so the buckets need padding
        for dp_mode, precision in (("zero1", "bf16"), ("zero1", "fp32"), ("ddp", "bf16"), ("fsdp", "fp32")):
            torch.manual_seed(0)
            stage = _stage(cfg, 1, 0, mesh)
            if dp_mode == "fsdp":
                for block in stage.layers:
                    fully_shard(block, mesh=mesh.device_mesh["dp"])
                module = fully_shard(stage, mesh=mesh.device_mesh["dp"])
                optimizer = torch.optim.AdamW(module.parameters())
            else:
                module = tp.optim.DataParallel(stage, group=mesh.dp_group, shard=dp_mode == "zero1",
                                               param_dtype=torch.bfloat16 if precision == "bf16" else None)
                params = list(module.parameters())
                optimizer = tp.optim.DistributedOptimizer(module, [
                    {"params": [p for p in params if p.dim() > 1]},
                    {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}])
            x = torch.randint(0, cfg.vocab_size, (2, 8))
            module(x, x).backward()
            optimizer.step()
            got = _max_over_ranks(list(tp.optim.memory_bytes(module, optimizer).values()))
            want = memory.parameter_memory(cfg, tp=tp_size, pp=1, stage=0, virtual_stages=1, dp_mode=dp_mode,
                                           precision=precision, shards=mesh.dp_size)[:3]
            assert got == want, (variant, dp_mode, precision, got, want)


def _first_log_record(flags):
    """models.train on these ranks for the flags; rank 0 returns its first log record."""
    import json
    import os
    import tempfile

    from models.training.cli import parser, train

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "log.jsonl")
        train(parser().parse_args([*flags, "--log-jsonl", path]))
        if dist.get_rank() == 0:
            with open(path) as f:
                return json.loads(f.readline())


@pytest.mark.parametrize("split,dp_mode,precision", [((2, 2, 1), "ddp", "fp32"), ((1, 2, 2), "fsdp", "fp32"),
                                                     ((1, 2, 2), "zero1", "bf16"), ((2, 1, 2), "ddp", "bf16"),
                                                     ((1, 1, 4), "fsdp", "bf16")])
def test_the_training_jobs_logged_bytes_equal_the_estimate(split, dp_mode, precision):
    """models.train's log (param_bytes, grad_bytes, optimizer_bytes: each the largest over the ranks) after its first
    step equals the estimate's largest stage per category, exactly: torch DDP and FSDP2 in fp32, and in bf16
    tp.optim.DataParallel (zero1: with the DistributedOptimizer) and FSDP2 with its mixed precision."""
    from tp import testing

    t, p, d = split
    flags = ["--tp", str(t), "--pp", str(p), "--dp", str(d), "--dp-mode", dp_mode, "--precision", precision,
             "--model", "tiny", "--steps", "1", "--global-batch-size", "4", "--micro-batch-size", "1",
             "--seq-len", "32"]
    log = testing.run(_first_log_record, world_size=4, timeout=300, flags=flags)[0]
    cfg = models.GPTConfig(**(models.config.PRESETS["tiny"] | {"max_seq_len": 256}))
    stages = [memory.parameter_memory(cfg, tp=t, pp=p, stage=s, virtual_stages=1, dp_mode=dp_mode,
                                      precision=precision, shards=d) for s in range(p)]
    want = tuple(max(stage[i] for stage in stages) for i in range(3))
    assert (log["param_bytes"], log["grad_bytes"], log["optimizer_bytes"]) == want


@distributed(world_size=2)
def test_fsdp_holds_the_stages_unsharded_parameters_and_grads_during_the_schedule():
    """FSDP2 under the runner keeps gradient sync and resharding off until the schedule's last backward (as
    torch.distributed.pipelining does): just before the reduce-scatter every rank holds the whole stage's unsharded
    parameters (bf16 under bf16) and fp32 gradients, which the estimate's transient counts exactly."""
    from torch.distributed.fsdp import fully_shard

    from models.training.model import wrap_data_parallel
    from tp.pipeline import PipelineRunner
    from tp.pipeline.runner import _param_groups  # (torch 2.11 and 2.13 name FSDP2's groups differently)

    mesh = tp.init_mesh(dp=2)
    cfg = config("gpt2")  # a tied embedding: one parameter
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        module = wrap_data_parallel(_stage(cfg, 1, 0, mesh), mesh, "fsdp", precision)
        runner = PipelineRunner(module, mesh, micro_batch_size=1, seq_len=16)
        held, finish = [], runner._finish_data_parallel

        def measure():
            total = 0
            for state in fully_shard.state(module)._state_ctx.all_states:
                for group in _param_groups(state):
                    for p in group.fsdp_params:
                        grad = p.unsharded_accumulated_grad
                        grad = p._unsharded_param.grad if grad is None else grad
                        total += p._unsharded_param.numel() * p._unsharded_param.element_size()
                        total += grad.numel() * grad.element_size() if grad is not None else 0
            held.append(total)
            finish()

        runner._finish_data_parallel = measure
        batches = [(torch.randint(0, cfg.vocab_size, (1, 16)),) * 2 for _ in range(2)]
        runner.run(batches, "1f1b")
        want = memory.parameter_memory(cfg, tp=1, pp=1, stage=0, virtual_stages=1, dp_mode="fsdp",
                                       precision=precision, shards=2)[3]
        assert held == [want], (precision, held, want)


@distributed(world_size=2)
def test_a_deferred_w_holds_what_the_estimate_counts():
    """Under tp.pipeline.defer_wgrad (ZB-H1's B) every linear keeps its input (re-gathered under SP) and output
    gradient until W: at tp = 2 with SP and GQA, one last stage's queue holds layer_wgrad_bytes per layer plus the
    output layer's input and vocabulary gradient, byte for byte."""
    from tp.pipeline import defer_wgrad

    mesh = tp.init_mesh(tp=2)
    for sp, precision in ((True, "fp32"), (False, "fp32")):
        cfg = config(sequence_parallel=sp)
        torch.manual_seed(0)
        stage = _stage(cfg, 1, 0, mesh)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16))
        with defer_wgrad() as queue:
            stage(tokens, tokens).backward()
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for job in queue._jobs for t in job[:2]}
        per_layer = memory.layer_wgrad_bytes(cfg, tp=2, micro_batch_size=2, seq_len=16, precision=precision)
        edge = 4 * 2 * 16 * (cfg.hidden_size + cfg.padded_vocab_size(2) // 2)  # the output layer's input, dlogits
        assert sum(held.values()) == cfg.num_layers * per_layer + edge, (sp, sum(held.values()))


def test_zb_counts_the_deferred_ws_of_the_last_stage():
    """ZB-H1's last rank runs F, B, F, B, ... and holds its W's back: at p = 4 up to 4 micro-batches' W state (or 1
    whole micro-batch and 3 W's) against 1F1B's 1 micro-batch; with a large vocabulary (its gradient kept for the
    output layer's W) that stage is the largest."""
    cfg = config(vocab_size=32000, num_layers=4)
    args = dict(tp=1, pp=4, dp=1, micro_batch_size=1, seq_len=64, sequence_parallel=False, recompute="none",
                dp_mode="ddp", precision="bf16", micro_batches=8)
    zb, one = memory.estimate(cfg, **args, schedule="zb"), memory.estimate(cfg, **args)
    shape = dict(tp=1, micro_batch_size=1, seq_len=64, precision="bf16")
    full = memory.layer_activation_bytes(cfg, sequence_parallel=False, recompute="none", **shape) + \
        memory.edge_activation_bytes(cfg, sequence_parallel=False, first=False, last=True, **shape)
    held = memory.layer_wgrad_bytes(cfg, **shape) + 2 * 64 * (cfg.hidden_size + cfg.padded_vocab_size(1))
    assert one.stage == zb.stage == 3 and one.activations == full + 2 * 64 * cfg.head_dim * 2  # + RoPE's cos/sin
    assert zb.activations == max(4 * held, full + 3 * held) + 2 * 64 * cfg.head_dim * 2


def _fsdp_held(module):
    """Bytes FSDP2 holds beyond its shards: every unsharded parameter's storage and its gradient."""
    from torch.distributed.fsdp import fully_shard

    from tp.pipeline.runner import _param_groups  # (torch 2.11 and 2.13 name FSDP2's groups differently)

    total = 0
    for state in fully_shard.state(module)._state_ctx.all_states:
        for group in _param_groups(state):
            for p in group.fsdp_params:
                unsharded = getattr(p, "_unsharded_param", None)
                if unsharded is not None:
                    total += unsharded.untyped_storage().nbytes()
                    total += unsharded.grad.untyped_storage().nbytes() if unsharded.grad is not None else 0
    return total


@distributed(world_size=2)
def test_fsdp2_resharding_peak_is_what_a_cpu_run_holds():
    """FSDP2 as torchtitan runs it (fully_shard per block, then the stage; resharding after forward and backward):
    the largest number of unsharded parameter and gradient bytes alive at any module boundary of a step, measured on
    two CPU ranks, equals the estimate's transient (fsdp_reshard=True) byte for byte in fp32; in bf16 but for the
    fp32 copy of a block's gradients the reduce-scatter makes inside FSDP2's post-backward (not observable here)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = tp.init_mesh(dp=2)
    cfg = config()
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        stage = models.GPT(cfg, group=mesh.tp_group)
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if precision == "bf16" else MixedPrecisionPolicy()
        for block in stage.layers:
            fully_shard(block, mesh=mesh.device_mesh["dp"], mp_policy=policy)
        module = fully_shard(stage, mesh=mesh.device_mesh["dp"], mp_policy=policy)
        peak = [0]

        def probe(*_):
            peak[0] = max(peak[0], _fsdp_held(module))
        for m in module.modules():
            for register in (m.register_forward_pre_hook, m.register_forward_hook, m.register_full_backward_pre_hook,
                             m.register_full_backward_hook):
                register(probe)
        tokens = torch.randint(0, cfg.vocab_size, (1, 16))
        module(tokens, tokens).backward()
        want = memory.parameter_memory(cfg, tp=1, pp=1, stage=0, virtual_stages=1, dp_mode="fsdp",
                                       precision=precision, shards=2, fsdp_reshard=True)[3]
        block = sum(math.prod(s) for _, s in memory.layer_parameter_shapes(cfg, 1, 0))
        cast = 4 * block if precision == "bf16" else 0
        assert peak[0] == want - cast, (precision, peak[0], want)
