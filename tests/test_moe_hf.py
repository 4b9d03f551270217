"""The GPT with MoE blocks against Hugging Face's Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (their expert loop is the
dense reference), at tp x ep (x etp, x cp) splits, each dp rank passing its own slice of the batch as in training:
logits, the LM loss, the load-balancing and z losses (computed by definition from HF's router logits over the global
batch) and every gradient (dense ones averaged over dp and summed over cp, experts summed over their edp group and
divided by dp, as training reduces them). HF weights in and out, bit exact, each rank reading only its experts."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
import tp
from models.hf import hf_state_dict
from tp.testing import distributed

from .helpers import assert_same_safetensors, rng
from .moe_reference import MARGIN, routing_margin

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 50, 8, 2  # per dp rank; the sequence splits over tp (SP) and cp (2·cp chunks)
AUX, Z = 0.1, 0.01


def hf_moe(family, *, experts=6, seed=0, dtype=torch.float64):
    """A tiny HF MoE causal LM with random weights, its experts computed by HF's loop (the dense reference)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=4, max_position_embeddings=64, num_experts_per_tok=3)
    config = {"mixtral": lambda: transformers.MixtralConfig(num_local_experts=experts, **common),
              "qwen2_moe": lambda: transformers.Qwen2MoeConfig(num_experts=experts, moe_intermediate_size=6,
                                                              shared_expert_intermediate_size=8, mlp_only_layers=[0],
                                                              **common),
              "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=6,
                                                              norm_topk_prob=True, **common),
              # (OLMoE's default pad_token_id=1 makes HF's embedding row 1 gradient-free: ours has no padding row)
              "olmoe": lambda: transformers.OlmoeConfig(num_experts=experts, pad_token_id=None, **common)}[family]()
    config._experts_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def batch(dp, seed=0):
    g = rng(seed)
    return torch.randint(0, VOCAB, (dp * BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (dp * BATCH, SEQ),
                                                                                  generator=g)


def reference(hf, x, y, topk):
    """HF on the global batch: logits, LM loss, the per-layer Switch and z losses over its router logits, and
    backward of their sum (the gradients ours must equal). An fp32 model's routing has no decision near a tie (tests/
    moe_reference.py): ours, split, routes alike."""
    out = hf(x, output_router_logits=True)
    margin = min(routing_margin(logits, topk) for logits in out.router_logits)
    assert hf.dtype == torch.float64 or margin >= MARGIN, f"HF routes within {margin:.2g} of a tie"
    lm = F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))
    lb = z = 0.0
    for logits in out.router_logits:
        E = logits.shape[-1]
        indices = logits.float().softmax(-1).topk(topk, dim=-1).indices
        f = torch.bincount(indices.flatten(), minlength=E).double() / indices.numel()
        lb = lb + AUX * E * (f * logits.double().softmax(-1).mean(0)).sum()
        z = z + Z * torch.logsumexp(logits.double(), -1).square().mean()
    (lm + lb + z).backward()
    return out.logits.detach(), lm.detach(), lb.detach(), z.detach()


def _reduce(t, group, dp):
    t = t.clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t / dp


SPLITS = {  # family: [(tp, sp, ep, etp, cp, dtype)]
    "mixtral": [(1, False, 2, None, 1, torch.float64), (2, True, 2, None, 1, torch.float32)],
    "qwen2_moe": [(2, True, 2, None, 1, torch.float64), (1, False, 4, None, 1, torch.float64)],
    "qwen3_moe": [(2, False, 1, 1, 1, torch.float64), (1, False, 2, None, 2, torch.float64)],
    "olmoe": [(2, True, 1, 2, 1, torch.float64), (1, False, 2, None, 1, torch.float32)],
}
CASES = [(family, *split) for family, splits in SPLITS.items() for split in splits]


@pytest.mark.parametrize("family,tp_size,sp,ep,etp,cp,dtype", CASES)
@distributed(world_size=4)
def test_moe_families_match_hugging_face(family, tp_size, sp, ep, etp, cp, dtype):
    mesh = tp.init_mesh(tp=tp_size, cp=cp, ep=ep, etp=etp)
    experts = 12 if ep == 4 else 6
    hf = hf_moe(family, experts=experts, dtype=dtype)
    torch.set_default_dtype(dtype)
    model = models.GPT.from_hf(hf, sequence_parallel=sp, moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z)
    X, Y = batch(mesh.dp_size)
    rows = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)  # this dp rank's micro-batch
    logits_ref, lm_ref, lb_ref, z_ref = reference(hf, X, Y, hf.config.num_experts_per_tok)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    with torch.no_grad():
        err = (model(X[rows]) - logits_ref[rows]).abs().max().item()
    assert err <= tol * 10, f"logits err {err}"
    loss = model(X[rows], Y[rows])
    loss.backward()
    assert abs(_reduce(loss.detach(), mesh.dp_group, mesh.dp_size).item() - lm_ref.item()) <= tol, "loss"
    aux = model.moe_aux_losses()
    assert abs(aux["load_balancing"].item() - lb_ref.item()) <= 1e-6 and abs(aux["z"].item() - z_ref.item()) <= 1e-6
    expected = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    ours = hf_state_dict(model, grads=True)
    assert set(ours) == set(expected), set(ours) ^ set(expected)
    for name, grad in ours.items():
        group = mesh.edp_group if ".experts." in name else mesh.group("dp-cp")
        err = (_reduce(grad, group, mesh.dp_size) - expected[name]).abs().max().item()
        assert err <= tol * max(1.0, expected[name].abs().max().item()) * 10, f"{name} grad err {err}"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@distributed(world_size=4)
def test_moe_hugging_face_round_trip_is_bit_exact_and_reads_only_its_experts(family):
    """Saved by transformers (per expert on disk) -> our GPT at tp 2 x ep 2 reading only its experts -> save_hf ->
    the same files' tensors, loadable by transformers, the same logits."""
    import shutil
    import tempfile

    from models.hf import load as hf_load

    mesh = tp.init_mesh(tp=2, ep=2)
    root = [tempfile.mkdtemp(prefix="tp-moe-roundtrip-") if mesh.rank == 0 else None]
    dist.broadcast_object_list(root)
    source, target = os.path.join(root[0], "source"), os.path.join(root[0], "target")
    if mesh.rank == 0:
        hf_moe(family, dtype=torch.float32).save_pretrained(source)
    dist.barrier()
    reads = []
    read = hf_load._SafetensorsReader.read
    hf_load._SafetensorsReader.read = lambda self, name, *a: reads.append(name) or read(self, name, *a)
    try:
        model = models.GPT.from_hf(source)
    finally:
        hf_load._SafetensorsReader.read = read
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in reads if ".experts." in n}
    assert experts == set(range(mesh.ep_rank * 3, mesh.ep_rank * 3 + 3)), experts  # its own experts only
    model.save_hf(target)
    dist.barrier()
    assert_same_safetensors(source, target)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(target, experts_implementation="eager").eval()
    state, hf = reloaded.state_dict(), hf_moe(family, dtype=torch.float32)
    assert all(torch.equal(state[name], t) for name, t in hf.state_dict().items())
    x, _ = batch(1)
    assert torch.equal(reloaded(x).logits, hf(x).logits)
    dist.barrier()
    if mesh.rank == 0:
        shutil.rmtree(root[0])
