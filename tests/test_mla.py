"""Multi-head latent attention (models/mla.py) with DeepSeek-V3's routing, where Hugging Face does not reach
(tests/test_deepseek_hf.py covers its families): dropout, documents, recompute, the all-gather and a2a+ring cp modes,
a v head wider than q/k, against the same GPT on one rank (built beside it from the same seed); torch.compile of its
blocks equals eager; bad MLA configurations name the value."""
import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.hf import hf_state_dict
from tp.testing import distributed

from .helpers import assert_close, rng

VOCAB, SEQ, BATCH = 50, 8, 2
MLA = dict(multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4,
           v_head_dim=6, rope_interleave=True)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "mscale_all_dim": 1.0}
BASE = dict(vocab_size=VOCAB, hidden_size=16, num_layers=3, num_heads=4, ffn_hidden_size=24, max_seq_len=32, **MLA,
            rope_scaling=YARN, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=6, moe_layer_freq=[0, 1, 1],
            moe_shared_expert_size=6, moe_router_score="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
            moe_router_topk_scaling_factor=2.5, moe_seq_aux_loss_coeff=0.01)
CASES = {  # name: (tp, sp, cp, cp_mode, cp_a2a_size, config changes, documents)
    "tp2 sp dropout documents selective": (2, True, 1, "ring", None,
                                           dict(dropout=0.1, attention_dropout=0.1, recompute="selective"), True),
    "cp2 allgather documents full": (1, False, 2, "allgather", None, dict(recompute="full"), True),
    "cp4 a2a+ring attention dropout": (1, False, 4, "a2a+ring", 2, dict(attention_dropout=0.1), False),
    "tp2 sp cp2 ring no q latent wide v": (2, True, 2, "ring", None, dict(q_lora_rank=None, v_head_dim=10), True),
}


def _reduce(t, group, dp):
    t = t.clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t / dp


def _documents(rows):
    """[rows, SEQ] document ids: each row's documents split at a few random points."""
    cuts = torch.rand(rows, SEQ, generator=torch.Generator().manual_seed(3)) < 0.3
    return cuts.long().cumsum(1)


@pytest.mark.parametrize("case", list(CASES))
@distributed(world_size=4)
def test_mla_gpt_matches_the_one_rank_model(case):
    tp_size, sp, cp, cp_mode, a2a, changes, documents = CASES[case]
    torch.set_default_dtype(torch.float64)
    config = models.GPTConfig(**(BASE | dict(cp_mode=cp_mode, cp_a2a_size=a2a) | changes))
    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    torch.manual_seed(0)
    serial = models.GPT(config, group=solo, cp_group=solo)
    mesh = tp.init_mesh(tp=tp_size, cp=cp)
    torch.manual_seed(0)
    model = models.GPT(config.replace(sequence_parallel=sp))
    g = rng(1)
    X = torch.randint(0, VOCAB, (mesh.dp_size * BATCH, SEQ), generator=g)
    Y = torch.randint(0, VOCAB, X.shape, generator=g)
    ids = torch.arange(len(X))
    docs = _documents(len(X)) if documents else None
    rows = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)
    mine = dict(sample_ids=ids[rows], document_ids=None if docs is None else docs[rows])
    serial_loss = serial(X, Y, sample_ids=ids, document_ids=docs)
    serial_loss.backward()
    loss = model(X[rows], Y[rows], **mine)
    loss.backward()
    assert abs(_reduce(loss.detach(), mesh.dp_group, mesh.dp_size).item() - serial_loss.item()) <= 1e-12
    sequence = _reduce(model.moe_aux_losses()["sequence"].double(), mesh.dp_group, mesh.dp_size)
    assert abs(sequence.item() - serial.moe_aux_losses()["sequence"].item()) <= 1e-6
    serial.eval(), model.eval()
    with torch.no_grad():
        expected = serial(X, document_ids=docs)[rows]
        assert_close(model(X[rows], document_ids=mine["document_ids"]), expected, 1e-11, "logits")
    expected, ours = hf_state_dict(serial, solo, grads=True), hf_state_dict(model, grads=True)
    assert set(ours) == set(expected)
    for name, grad in ours.items():
        group = mesh.edp_group if ".experts." in name else mesh.group("dp-cp")
        err = (_reduce(grad, group, mesh.dp_size) - expected[name]).abs().max().item()
        assert err <= 1e-11 * max(1.0, expected[name].abs().max().item()), f"{name} grad err {err}"


@distributed(world_size=2, timeout=300)
def test_mla_blocks_compile_and_equal_eager():
    """GPT.compile_blocks with MLA (one MoE block: group-limited routing, the sequence-wise loss) at tp 2 with SP:
    fullgraph, the step equals eager."""
    tp.init_mesh(tp=2)
    config = models.GPTConfig(**(BASE | dict(num_layers=1, moe_layer_freq=[1], sequence_parallel=True)))
    model, twin = (models.GPT(config) for _ in range(2))
    twin.load_state_dict(model.state_dict())
    twin.compile_blocks(backend="aot_eager")
    tokens, targets = (torch.randint(0, VOCAB, (2, SEQ), generator=rng(7)) for _ in range(2))
    want, got = model(tokens, targets), twin(tokens, targets)
    want.backward()
    got.backward()
    assert_close(got, want, 1e-5, "loss")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(q.grad, p.grad, 1e-5, f"grad of {name}")


@pytest.mark.parametrize("changes,message", [
    (dict(kv_lora_rank=None), r"kv_lora_rank=None must be an integer >= 1 with multi_latent_attention"),
    (dict(q_lora_rank=0), r"q_lora_rank=0 must be an integer >= 1 with multi_latent_attention \(or None"),
    (dict(qk_rope_head_dim=3), r"an even number of rotated features \(qk_rope_head_dim=3"),
    (dict(bias=True), r"bias=True with multi_latent_attention"),
    (dict(num_kv_heads=2), r"num_kv_heads=2 with multi_latent_attention: every head has its own keys and values"),
    (dict(multi_latent_attention=False), r"q_lora_rank=8 is multi-head latent attention's"),
    (dict(rotary_percent=0.0), r"rotary_percent=0.0 must be in \(0, 1\]"),
    (dict(moe_router_num_groups=3), r"moe_router_num_groups=3 must be an integer >= 1 dividing num_experts=8"),
    (dict(moe_router_group_topk=None), r"moe_router_group_topk=None must be an integer in \[1, "),
    (dict(moe_router_group_topk=5), r"moe_router_group_topk=5 must be an integer in \[1, moe_router_num_groups=4\]"),
    (dict(moe_seq_aux_loss_coeff=-1.0), r"moe_seq_aux_loss_coeff=-1.0 must be a finite number >= 0"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"yarn scaling needs finite positive numbers for "
                                                              r"\['original_max_position_embeddings'\]"),
    (dict(rope_scaling=YARN | {"mscale": -1}), r"yarn scaling needs finite numbers >= 0 for \['mscale'\]"),
])
def test_bad_mla_and_routing_configs_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        models.GPTConfig(**(BASE | changes))


def test_yarn_frequencies_and_scales_are_hugging_faces():
    """YaRN's inverse frequencies, its cos/sin factor and MLA's softmax-scale correction, against transformers'."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.mla import softmax_scale
    from models.rope import rope_attention_factor, rope_frequencies

    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
    hf = DeepseekV3Config(rope_parameters={"rope_theta": 10000.0, **scaling}, max_position_embeddings=163840)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert torch.equal(rope_frequencies(64, 10000.0, scaling), inv_freq)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    config = models.GPTConfig(**(BASE | dict(qk_nope_head_dim=128, qk_rope_head_dim=64, rope_scaling=scaling)))
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    assert softmax_scale(config) == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192 ** -0.5), rel=1e-12)


@distributed(world_size=1)
def test_mla_and_mtp_flops_match_a_count_of_the_models_matmuls():
    """models.flops with multi-head latent attention (query latent or not, v wider or narrower) and MTP depths
    equals torch's FlopCounterMode over one training forward and backward (math attention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from models.flops import flops_per_token

    tp.init_mesh(tp=1)
    base = dict(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=48, max_seq_len=24, **MLA)
    for changes in ({}, {"q_lora_rank": None, "v_head_dim": 10, "mtp_num_layers": 2}, {"mtp_num_layers": 1}):
        config = models.GPTConfig(**(base | changes))
        model = models.GPT(config)
        x, y = torch.randint(0, 256, (3, 24)), torch.randint(0, 256, (3, 24))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x, y).backward()
        assert counter.get_total_flops() == 3 * 24 * flops_per_token(config, 24), changes


def test_deepseek_v3_and_kimi_k2_parameters_are_their_published_counts():
    """The deepseek-v3 preset holds 671B parameters, 37B active per token (DeepSeek-V3 report, arXiv:2412.19437);
    kimi-k2 1T, 32B active (moonshotai/Kimi-K2-Instruct's model card); the MTP depth's block and projection on top."""
    from models.flops import matmul_params

    def billions(name, **changes):
        config = models.GPTConfig(**models.presets.MODELS[name]).replace(**changes)
        embeddings = 2 * config.vocab_size * config.hidden_size
        return [(matmul_params(config, active=active) + embeddings) / 1e9 for active in (False, True)]

    assert [int(b) for b in billions("deepseek-v3", mtp_num_layers=0)] == [671, 37]
    assert [int(b) for b in billions("kimi-k2")] == [1026, 32]
    assert 11 < billions("deepseek-v3")[0] - billions("deepseek-v3", mtp_num_layers=0)[0] < 12
