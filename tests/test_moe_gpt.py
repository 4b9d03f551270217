"""The GPT with MoE blocks at tp x ep (x etp, x cp) splits against the same GPT on one rank (built beside it from
the same seed on a one-rank group), for what Hugging Face's families do not cover (tests/test_moe_hf.py does
those): sigmoid routing with its bias, DeepSeek's dense first layer, a shared expert, capacity drops, the allgather
dispatcher, recomputation, gradient accumulation with the aux loss scaled like the LM loss. Logits, the
LM loss (averaged over dp), the aux and z losses and every gradient (dense averaged over dp and summed over cp,
experts summed over edp and divided by dp); fp64 to ~1e-12, fp32 to ~1e-5."""
import pytest
import torch
import torch.distributed as dist

import models
import tp
from models.hf import hf_state_dict
from tp.testing import distributed

from .helpers import rng
from .moe_reference import MARGIN, routing_margins

VOCAB, SEQ, BATCH = 50, 8, 2
BASE = dict(vocab_size=VOCAB, hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=24,
            max_seq_len=32, num_experts=6, moe_router_topk=2, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.1,
            moe_z_loss_coeff=0.01)
CASES = {  # name: (tp, sp, ep, etp, cp, dtype, config changes, micro-batches)
    "sigmoid-shared-dense-first-recompute tp2sp ep2": (
        2, True, 2, None, 1, torch.float64, dict(moe_router_score="sigmoid", moe_shared_expert_size=8,
                                                 moe_shared_expert_gate=True, moe_layer_freq=[0, 1, 1],
                                                 recompute="full"), 1),
    "capacity tp1 ep4": (1, False, 4, None, 1, torch.float64, dict(num_experts=8, moe_capacity_factor=1.0), 1),
    "allgather cp2 ep2": (1, False, 2, None, 2, torch.float32, dict(moe_dispatcher="allgather"), 1),
    "replicated tp2 ep2 etp1 accumulation": (2, False, 2, 1, 1, torch.float64, dict(recompute="selective"), 2),
    "dropout tp2sp ep2 dp2": (2, True, 2, None, 1, torch.float64, dict(dropout=0.2, attention_dropout=0.2), 2),
}


def _reduce(t, group, dp):
    t = t.clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t / dp


def _step(model, X, Y, micro_batches, samples):
    """Forward and backward over `micro_batches` slices of the batch, the losses and aux losses scaled by 1/n;
    `samples`: the rows' global indices (they key the dropout masks)."""
    model.set_moe_aux_loss_scale(1.0 / micro_batches)
    losses, aux = [], []
    for x, y, ids in zip(X.chunk(micro_batches), Y.chunk(micro_batches), samples.chunk(micro_batches)):
        loss = model(x, y, sample_ids=ids)
        (loss / micro_batches).backward()
        losses.append(loss.detach())
        aux.append(model.moe_aux_losses())
    return losses, aux


@pytest.mark.parametrize("case", list(CASES))
@distributed(world_size=4)
def test_moe_gpt_matches_the_one_rank_model(case):
    tp_size, sp, ep, etp, cp, dtype, changes, micro_batches = CASES[case]
    torch.set_default_dtype(dtype)
    config = models.GPTConfig(**(BASE | changes))
    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    torch.manual_seed(0)
    serial = models.GPT(config, group=solo)  # no mesh yet: every MoE group is this one rank
    mesh = tp.init_mesh(tp=tp_size, cp=cp, ep=ep, etp=etp)
    torch.manual_seed(0)
    model = models.GPT(config.replace(sequence_parallel=sp))
    g = rng(1)
    X = torch.randint(0, VOCAB, (mesh.dp_size * BATCH * micro_batches, SEQ), generator=g)
    Y = torch.randint(0, VOCAB, X.shape, generator=g)
    rows = torch.arange(X.shape[0]).view(micro_batches, mesh.dp_size, BATCH)[:, mesh.dp_rank].flatten()
    with routing_margins(serial, config.moe_capacity_factor) as margins:
        serial_losses, serial_aux = _step(serial, X, Y, micro_batches, torch.arange(len(X)))
    # fp32 routing compared across splits: no decision near a tie (tests/moe_reference.py)
    assert dtype == torch.float64 or min(margins) >= MARGIN, f"routed within {min(margins):.2g} of a tie"
    losses, aux = _step(model, X[rows], Y[rows], micro_batches, rows)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for ours, theirs, a, b in zip(losses, serial_losses, aux, serial_aux):
        assert abs(_reduce(ours, mesh.dp_group, mesh.dp_size).item() - theirs.item()) <= tol
        for key in ("load_balancing", "z"):
            assert abs(a[key].item() - b[key].item()) <= 1e-6, key
    if config.moe_router_score == "sigmoid":  # the loads the bias update will use: counted once under recompute
        for ours, theirs in zip(model.modules(), serial.modules()):
            if isinstance(ours, tp.moe.TopKRouter):
                assert torch.equal(_reduce(ours.expert_load, mesh.group("tp-cp-dp"), 1), theirs.expert_load)
    with torch.no_grad():
        logits = serial(X, sample_ids=torch.arange(len(X)))[rows]
        err = (model(X[rows], sample_ids=rows) - logits).abs().max().item()  # (capacity: over the same global tokens)
    assert err <= 10 * tol, f"logits err {err}"
    expected, ours = hf_state_dict(serial, solo, grads=True), hf_state_dict(model, grads=True)
    assert set(ours) == set(expected)
    for name, grad in ours.items():
        group = mesh.edp_group if ".experts." in name else mesh.group("dp-cp")
        err = (_reduce(grad, group, mesh.dp_size) - expected[name]).abs().max().item()
        assert err <= 10 * tol * max(1.0, expected[name].abs().max().item()), f"{name} grad err {err}"


@pytest.mark.parametrize("changes,message", [
    (dict(moe_router_topk=7), r"moe_router_topk=7 > num_experts=6"),
    (dict(moe_layer_freq=[1, 0]), r"moe_layer_freq=\[1, 0\] must give 0 or 1 for each of the 3 layers"),
    (dict(moe_layer_freq=0), r"moe_layer_freq=0 must be an integer >= 1 or a 0/1 list per layer"),
    (dict(moe_router_score="softplus"), r"moe_router_score='softplus' must be one of \('softmax', 'sigmoid'\)"),
    (dict(moe_dispatcher="p2p"), r"moe_dispatcher='p2p' must be one of"),
    (dict(moe_capacity_factor=0.0), r"moe_capacity_factor=0.0 must be a positive number"),
    (dict(num_experts=-1), r"num_experts=-1 must be an integer >= 0"),
    (dict(qk_norm="layer"), r"qk_norm='layer' must be one of \('head', 'full'\)"),
    (dict(moe_aux_loss_coeff=-1.0), r"moe_aux_loss_coeff=-1.0 must be >= 0"),
])
def test_bad_moe_configs(changes, message):
    with pytest.raises(ValueError, match=message):
        models.GPTConfig(**(BASE | changes))


def test_moe_config_helpers_and_presets():
    config = models.GPTConfig(**(BASE | dict(moe_layer_freq=2)))
    assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert not models.GPTConfig(**(BASE | dict(num_experts=0))).is_moe_layer(0)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by ep=4"):
        config.check_experts(4, 1)
    with pytest.raises(ValueError, match=r"moe_ffn_hidden_size=8 is not divisible by etp=3"):
        config.check_experts(2, 3)
    with pytest.raises(ValueError, match=r"moe_shared_expert_size=6 is not divisible by tp=4"):
        config.replace(moe_shared_expert_size=6).check_tp(4)
    tiny = models.GPTConfig(**models.config.PRESETS["tiny-moe"])
    small = models.GPTConfig(**models.config.PRESETS["small-moe"])
    assert tiny.num_experts == 8 and all(tiny.is_moe_layer(i) for i in range(4))
    assert small.moe_shared_expert_size and not small.is_moe_layer(0) and small.is_moe_layer(1)


def test_hugging_face_refuses_what_its_moe_families_cannot_hold():
    from models import hf as hf_io

    assert hf_io.hf_family(models.GPTConfig(**BASE)) == "mixtral"
    with pytest.raises(ValueError, match=r"no Hugging Face mixtral equivalent.*moe_router_score='sigmoid'"):
        hf_io.check_hf(models.GPTConfig(**(BASE | dict(ffn_hidden_size=8, moe_router_score="sigmoid"))))
    with pytest.raises(ValueError, match=r"qwen2_moe: a shared expert"):
        hf_io.check_hf(models.GPTConfig(**(BASE | dict(hf_model_type="qwen2_moe", qkv_bias=True))))
    with pytest.raises(ValueError, match=r"num_experts=6 \(llama: no experts\)"):
        hf_io.check_hf(models.GPTConfig(**(BASE | dict(hf_model_type="llama"))))
    ok = models.GPTConfig(**(BASE | dict(hf_model_type="qwen3_moe", qk_norm="head", moe_layer_freq=[0, 1, 1])))
    assert hf_io.check_hf(ok) == "qwen3_moe"
    assert hf_io.config_to_hf(ok).mlp_only_layers == [0]

