"""bench.plan prices multi-head latent attention and multi-token prediction (models/mla.py, models/mtp.py): the
parameters of real tiny-deepseek stages at tp 1 and 2 (q latent or not, pp 1 and 2), DeepSeek-V3's counts and FLOPs
against hand counts from its published shape (arXiv:2412.19437: 671B parameters, 37B activated), an MLA layer's
saved activations by hand and against a CPU run (saved_tensors_hooks), the GEMMs and collectives of its tp split, and
a DeepSeek-V3 plan on the h800 profile."""
import math

import torch

import models
import tp
from bench import roofline as rl
from bench.plan import cli as plan
from bench.plan import hardware as hw
from bench.plan import memory, search
from bench.plan import step_time as pm
from models.block import TransformerBlock
from models.flops import flops_per_token
from models.presets import MODELS
from tp.testing import distributed

DEEPSEEK = models.GPTConfig(**MODELS["deepseek-v3"])
# a dense MLA model whose q·k and v widths agree (12), so that CPU SDPA takes its flash path (keeping no scores) as
# the GPU kernels do; with unequal widths CPU SDPA falls back to the math path and keeps the s × s probabilities
TINY_MLA = dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=40, max_seq_len=64,
                norm_eps=1e-6, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=12, rope_interleave=True)


def _deepseek_by_hand():
    """(attention weights per layer, active and total matmul weights of the 61 layers) from the published shape:
    q 7168 → 1536 → 128·192, kv 7168 → 512 + 64, 512 → 128·(128 + 128), output 128·128 → 7168; 3 dense SwiGLU
    layers of 18432; 58 MoE layers of 256 experts (8 routed + 1 shared active) of 2048 and a [256, 7168] router."""
    h = 7168
    attention = h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * 256 + 128 * 128 * h
    dense, expert, router = 3 * h * 18432, 3 * h * 2048, 256 * h
    active = 61 * attention + 3 * dense + 58 * (router + 9 * expert)
    total = 61 * attention + 3 * dense + 58 * (router + 257 * expert)
    return attention, active, total


def test_deepseek_v3_parameters_match_the_published_counts():
    """The planner's counts equal the hand count; the main model (without its MTP module) holds 671B within 1 %,
    as the report states; 37B activated: the report's figure to the nearest billion counts the matmul weights and the
    output layer (36.6B; with the input embedding, which multiplies nothing, 37.6B)."""
    _, active, total = _deepseek_by_hand()
    embedding = 129280 * 7168
    main = DEEPSEEK.replace(mtp_num_layers=0)
    got_active, got_total = search.parameter_counts(main)
    norms = 61 * (2 * 7168 + 1536 + 512) + 7168  # the blocks' and latents' RMSNorms, the final norm
    assert got_total == total + 2 * embedding + norms
    assert abs(got_total - 671e9) <= 0.01 * 671e9
    assert got_active == active + 2 * embedding + norms
    assert round((active + embedding) / 1e9) == 37
    # the MTP module: one more MoE block, its [2h → h] projection and three norms (the output head shared)
    attention, _, _ = _deepseek_by_hand()
    mtp = attention + 256 * 7168 + 257 * 3 * 7168 * 2048 + 2 * 7168 ** 2 + 2 * 7168 + 1536 + 512 + 3 * 7168
    assert search.parameter_counts(DEEPSEEK)[1] - got_total == mtp


def test_deepseek_v3_flops_are_models_flops_and_the_hand_count():
    """6 · active matmul weights (the MTP depth's block and projection with them) + 6·(61 + 1)·128·(192 + 128)·s
    attention + 6·2·h·V logits (the main head and the MTP depth's pass)."""
    attention, active, _ = _deepseek_by_hand()
    mtp = attention + 256 * 7168 + 9 * 3 * 7168 * 2048 + 2 * 7168 ** 2
    s = 4096
    hand = 6 * (active + mtp) + 6 * 62 * 128 * (192 + 128) * s + 6 * 2 * 7168 * 129280
    assert flops_per_token(DEEPSEEK, s) == hand
    assert pm.model_flops_per_token(DEEPSEEK, s) == hand
    # selective recompute repeats the core's forward at its own widths
    assert pm.recompute_flops_per_token(DEEPSEEK, s, "selective") == 2 * 61 * 128 * (192 + 128) * s


def test_mla_layer_activations_by_hand():
    """DeepSeek-V3's MLA layer at tp 1, one 4096-token sequence, bf16: the latent norms (fp32 input, rstd, normed
    output), the whole latents, q and k (192 wide), v in the kv up-projection's output (256 wide), the output and
    the projection's copy of it (128), the fp32 log-sum-exp; the rest is the dense block's."""
    T, e, a = 4096, 2, 128
    latent_norms = (4 + e) * T * 1536 + 4 * T + (4 + e) * T * 512 + 4 * T
    attention = latent_norms + e * T * (1536 + 512 + 64) + e * T * a * (2 * 192 + 256 + 2 * 128) + 4 * T * a
    norms = 2 * ((4 + 2 * e) * T * 7168 + 4 * T)
    mlp = e * T * (2 * 18432 + 18432)
    got = memory.layer_activation_bytes(DEEPSEEK, tp=1, micro_batch_size=1, seq_len=T, sequence_parallel=False,
                                        recompute="none", precision="bf16")
    assert got == norms + attention + mlp
    # tp 8 with SP: heads and the kernel's tensors / 8, the norms on T/8 rows, the gathered latents whole
    got = memory.mla_activation_bytes(DEEPSEEK, tp=8, tokens=T, rows=T // 8, precision="bf16")
    assert got == latent_norms // 8 + e * T * 2112 + e * T * 16 * (2 * 192 + 256 + 2 * 128)


def test_mla_gemms_and_collectives_follow_the_tp_split():
    """The attention GEMMs' FLOPs are 6·T·attention weights at tp 1, and their 1/tp share under SP (the replicated
    down-projections over the rank's tokens); without SP every rank projects every token down. SP moves the latents
    (2112 features) in place of the hidden state (7168) for the up-projections."""
    tokens = 4096
    attention, _, _ = _deepseek_by_hand()

    def flops(**fields):
        p = pm.Plan(**(dict(tp=1, cp=1, pp=1, virtual_stages=1, dp=1, micro_batch_size=1) | fields))
        return sum(g.flops for g in pm.attention_gemms(DEEPSEEK, p, tokens))

    assert flops() == 6 * tokens * attention
    assert flops(tp=8, sp=True) == 6 * tokens * attention // 8
    down = 7168 * (1536 + 576)
    assert flops(tp=8) == 6 * tokens * ((attention - down) // 8 + down)
    p = pm.Plan(tp=8, cp=1, pp=1, virtual_stages=1, dp=1, micro_batch_size=1, sp=True)
    sizes = sorted((c.kind, c.phase, c.size) for c in pm.mla_collectives(DEEPSEEK, p, tokens, 2))
    latents, hidden, weights = 2 * tokens * 2112, 2 * tokens * 7168, 2 * 7168 * 2112
    assert sizes == sorted([(rl.ALL_GATHER, "fwd", latents), (rl.REDUCE_SCATTER, "bwd", latents),
                            (rl.REDUCE_SCATTER, "fwd", hidden), (rl.ALL_GATHER, "bwd", hidden),
                            (rl.ALL_REDUCE, "bwd", weights)])


def test_deepseek_v3_plan_on_h800():
    """The h800 profile (a registry entry, so a --hardware choice): the H100's compute, NVLink 200 GB/s per direction;
    DeepSeek-V3's published split (pp 16, ep 64, no tp) fits and is priced, its last stage holding the MTP depth."""
    h800 = hw.CLUSTERS["h800"]
    assert "h800" in plan.parser().parse_args(["--hardware", "h800"]).hardware
    assert (h800.device.flops, h800.device.link, h800.device.inter_node) == (989e12, 200e9, 50e9)
    assert h800.device.link < hw.CLUSTERS["h100-sxm"].device.link
    p = pm.Plan(tp=1, cp=1, pp=16, virtual_stages=1, dp=128, micro_batch_size=1, recompute="full",
                dp_mode="zero1", ep=64)
    row = search.evaluate(DEEPSEEK, p, seq_len=4096, global_batch_size=15360, cluster=h800, software=pm.OURS)
    assert row["fits"] and row["tokens_per_s"] > 0 and row["slowest_stage"] == 15
    last, without = (memory.stage_numel(c, 1, 16, 15, ep=64) for c in (DEEPSEEK, DEEPSEEK.replace(mtp_num_layers=0)))
    assert last - without == 129280 * 7168 + sum(math.prod(s) for _, s in memory.layer_parameter_shapes(
        DEEPSEEK, 1, 60, ep=64)) + 2 * 7168 ** 2 + 3 * 7168  # the embedding's copy, the block, proj, norms


def _saved_in_blocks(model, step):
    """Bytes of the distinct storages autograd saves inside the TransformerBlocks while step() runs (parameters
    excluded)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    inside, saved = [0], {}

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage._cdata not in params:
            saved.setdefault(storage._cdata, storage.nbytes())
        return t

    hooks = [m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1)) for m in model.modules()
             if isinstance(m, TransformerBlock)]
    hooks += [m.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1)) for m in model.modules()
              if isinstance(m, TransformerBlock)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        for hook in hooks:
            hook.remove()
    return sum(saved.values())


@distributed(world_size=2)
def test_mla_stages_and_saved_activations_are_the_estimates():
    """tiny-deepseek's stages (q latent and none, pp 1 and 2) at tp 1 and 2 hold the planner's parameter shapes
    (down-projections whole, up-projections over heads, the MTP depth and the embedding's copy on the last stage);
    a dense MLA model saves the estimate's activations (tp 1 bf16, tp 2 with SP fp32) within 2 %."""
    for size in (1, 2):
        tp.init_mesh(tp=size)  # (at tp 1 two dp ranks: each builds the whole model)
        for q in (32, None):
            config = models.GPTConfig(**(MODELS["tiny-deepseek"] | dict(q_lora_rank=q)))
            for pp, stage in ((1, 0), (2, 0), (2, 1)):
                start, stop = models.stages.stage_layers(config.num_layers, pp, stage)
                model = models.GPT(config, layers=(start, stop), pre_process=stage == 0, post_process=stage == pp - 1)
                assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == \
                    memory.stage_parameter_shapes(config, size, pp, stage), (size, q, pp, stage)
        sp, precision = size > 1, ("bf16", "fp32")[size - 1]
        config = models.GPTConfig(**TINY_MLA, sequence_parallel=sp)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        model = models.GPT(config).to(dtype)
        if size == 1 and precision == "bf16":  # the training job's fp32 main_grad (as tests/test_memory.py)
            for p in model.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        tokens = torch.randint(0, 100, (3, 16))
        got = _saved_in_blocks(model, lambda: model(tokens, tokens))
        want = config.num_layers * memory.layer_activation_bytes(
            config, tp=size, micro_batch_size=3, seq_len=16, sequence_parallel=sp, recompute="none",
            precision=precision, backend="torch") + 2 * memory.PRECISIONS[precision] * 16 * 4  # RoPE's cos/sin
        assert abs(got - want) <= 0.02 * want, (size, sp, precision, got, want)
        tp.destroy_mesh()
