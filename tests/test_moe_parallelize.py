"""tp.parallelize on Hugging Face's MoE families: their plans' experts entries (moe_tp_experts / ep_dispatch_experts,
packed_colwise / grouped_gemm on the weights) run tp.moe.ParallelExperts, the experts split over the mesh's ep and
etp; against the unparallelized HF model on the global batch (each dp rank passing its slice): logits, loss and
every gradient (dense averaged over dp, experts summed over edp and divided by dp); save_pretrained gathers."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp
from tp.embedding import VocabParallelEmbedding
from tp.layers import ColumnParallelLinear, RowParallelLinear
from tp.testing import distributed

from .test_moe_hf import BATCH, VOCAB, batch, hf_moe

transformers = pytest.importorskip("transformers")

CASES = [("mixtral", 2, 1, None), ("qwen2_moe", 2, 2, 1), ("qwen3_moe", 1, 2, None), ("olmoe", 2, 2, 1),
         ("mixtral", 1, 4, None)]  # family, tp, ep, etp


def dense_grads(model):
    """Every parameter's gradient, gathered to the dense HF shape (collective over tp, etp, ep)."""
    out = {}
    for name, sub in model.named_modules():
        for pname, p in sub.named_parameters(recurse=False):
            if p.grad is not None:
                if isinstance(sub, tp.moe.ParallelExperts):
                    grad = sub.gather_dense(p.grad, pname)
                elif isinstance(sub, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                    grad = sub.gather_dense(p.grad)
                else:
                    grad = p.grad
                out[f"{name}.{pname}"] = grad
    return out


def _reduce(t, group, dp):
    t = t.clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t / dp


@pytest.mark.filterwarnings("ignore:tp.parallelize")
@pytest.mark.parametrize("family,tp_size,ep,etp", CASES)
@distributed(world_size=4)
def test_parallelize_runs_hugging_face_moe_plans_exactly(family, tp_size, ep, etp):
    mesh = tp.init_mesh(tp=tp_size, ep=ep, etp=etp)
    experts = 12 if ep == 4 else 6
    reference, model = hf_moe(family, experts=experts), hf_moe(family, experts=experts)
    tp.parallelize(model)
    assert isinstance(model.model.layers[1].mlp.experts, tp.moe.ParallelExperts)
    assert "moe_experts" in tp.describe(model)
    X, Y = batch(mesh.dp_size)
    rows = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)
    logits_ref = reference(X).logits
    F.cross_entropy(logits_ref.reshape(-1, VOCAB), Y.reshape(-1)).backward()
    logits = model(X[rows]).logits
    assert (logits - logits_ref[rows]).abs().max().item() <= 1e-12
    F.cross_entropy(logits.reshape(-1, VOCAB), Y[rows].reshape(-1)).backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    ours = dense_grads(model)
    assert set(ours) == set(expected), set(ours) ^ set(expected)
    for name, grad in ours.items():
        group = mesh.edp_group if ".experts." in name else mesh.dp_group
        err = (_reduce(grad, group, mesh.dp_size) - expected[name]).abs().max().item()
        assert err <= 1e-12, f"{name} grad err {err}"
    for odd in (X[:1, :5], X[:1, :1]):  # token counts tp does not divide (a prompt, a decoding step)
        with torch.no_grad():
            assert (model(odd).logits - reference(odd).logits).abs().max().item() <= 1e-12, odd.shape


@pytest.mark.filterwarnings("ignore:tp.parallelize")
@distributed(world_size=4)
def test_parallelized_moe_saves_the_dense_model():
    """save_pretrained of a tp 2 x ep 2 parallelized Mixtral: the dense experts gathered, transformers reads them."""
    import shutil
    import tempfile

    mesh = tp.init_mesh(tp=2, ep=2)
    model = hf_moe("mixtral", dtype=torch.float32)
    tp.parallelize(model)
    root = [tempfile.mkdtemp(prefix="tp-moe-parallelize-") if mesh.rank == 0 else None]
    dist.broadcast_object_list(root)
    state = tp.full_state_dict(model)
    model.save_pretrained(root[0], is_main_process=mesh.dp_rank == 0)
    dist.barrier()
    original = hf_moe("mixtral", dtype=torch.float32).state_dict()
    assert set(state) == set(original) and all(torch.equal(state[k], original[k]) for k in state)
    fresh = tp.parallelize(hf_moe("mixtral", dtype=torch.float32))  # the dense state dict back into one: this
    with torch.no_grad():  # rank's experts (ep), their etp slices (the experts' slice was left out at ep 2)
        for p in fresh.parameters():
            p.zero_()
    tp.load_full_state_dict(fresh, state)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(root[0], experts_implementation="eager")
    assert all(torch.equal(t, original[k]) for k, t in reloaded.state_dict().items())
    dist.barrier()
    if mesh.rank == 0:
        assert os.path.exists(os.path.join(root[0], "model.safetensors"))
        shutil.rmtree(root[0])


@pytest.mark.parametrize("plan,message", [
    ({"model.layers.*.mlp.gate": "moe_tp_experts"}, r"model.layers.0.mlp.gate is MixtralTopKRouter; style "
                                                    r"'moe_experts' .* needs transformers' fused experts"),
    ({"model.layers.*.mlp.experts": "ep_dispatch_experts"}, r"num_experts=6 is not divisible by ep=4"),
])
@distributed(world_size=4)
def test_bad_moe_plans_raise_on_every_rank(plan, message):
    tp.init_mesh(ep=4)
    model = hf_moe("mixtral", dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        tp.parallelize(model, plan)
    assert not isinstance(model.model.layers[0].mlp.experts, tp.moe.ParallelExperts)  # unchanged
