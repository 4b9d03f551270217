"""DeepSeek-V3 (its query latent set and unset, YaRN), DeepSeek-V2 and GLM-4.5 MoE from tiny random transformers
models: the GPT's logits, LM loss and every gradient equal Hugging Face's at tp (± SP), ep, tp x ep x etp, cp (ring,
a2a) and pp splits, each dp rank passing its own slice of the batch (dense gradients averaged over dp and summed over
cp, experts summed over edp and divided by dp, as training reduces them); their routers (group-limited top-k, the
selection bias, the scaling factor) choose as HF's; weights in and out bit exact, transformers reads the export."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
import tp
from models.hf import hf_state_dict
from models.stages import stage_options
from tp.testing import distributed

from .helpers import assert_same_safetensors, rng

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 50, 8, 2  # per dp rank


def hf_deepseek(family, *, q_lora=8, yarn=False, dtype=torch.float64, seed=0):
    """A tiny HF model of `family` with random weights and a random selection bias, experts by HF's loop."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=12, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=64, num_experts_per_tok=2, moe_intermediate_size=6, n_shared_experts=1,
                  n_routed_experts=8, first_k_dense_replace=1, n_group=4, topk_group=2, pad_token_id=None)
    mla = dict(q_lora_rank=q_lora, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
            "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 8, "beta_slow": 1} if yarn else None
    config = {
        "deepseek_v3": lambda: transformers.DeepseekV3Config(**common, **mla, routed_scaling_factor=2.5,
                                                             num_key_value_heads=4, rope_parameters=rope),
        "deepseek_v2": lambda: transformers.DeepseekV2Config(**common, **mla, routed_scaling_factor=1.5,
                                                             topk_method="group_limited_greedy"),
        "glm4_moe": lambda: transformers.Glm4MoeConfig(**common, num_key_value_heads=2, head_dim=8,
                                                       routed_scaling_factor=2.5, attention_bias=True,
                                                       use_qk_norm=True)}[family]()
    config._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(seed + 1)) * 0.1)
    return model


# name: (family, hf options, tp, sp, ep, etp, cp, cp_mode, pp, dtype)
CASES = {
    "v3 tp2 sp fp32": ("deepseek_v3", {}, 2, True, 1, None, 1, "ring", 1, torch.float32),
    "v3 ep2": ("deepseek_v3", {}, 1, False, 2, None, 1, "ring", 1, torch.float64),
    "v3 tp2 ep2 etp1": ("deepseek_v3", {}, 2, False, 2, 1, 1, "ring", 1, torch.float64),
    "v3 cp2 ring": ("deepseek_v3", {}, 1, False, 1, None, 2, "ring", 1, torch.float64),
    "v3 cp2 a2a": ("deepseek_v3", {}, 1, False, 1, None, 2, "a2a", 1, torch.float64),
    "v3 pp2": ("deepseek_v3", {}, 1, False, 1, None, 1, "ring", 2, torch.float64),
    "v3 no q latent yarn tp2 sp ep2": ("deepseek_v3", dict(q_lora=None, yarn=True), 2, True, 2, None, 1, "ring", 1,
                                       torch.float64),
    "v3 no q latent yarn cp2 a2a": ("deepseek_v3", dict(q_lora=None, yarn=True), 1, False, 1, None, 2, "a2a", 1,
                                    torch.float32),
    "v2 tp2 sp ep2": ("deepseek_v2", {}, 2, True, 2, None, 1, "ring", 1, torch.float64),
    "v2 cp2 ring": ("deepseek_v2", {}, 1, False, 2, None, 2, "ring", 1, torch.float64),
    "glm tp2 sp ep2": ("glm4_moe", {}, 2, True, 2, None, 1, "ring", 1, torch.float64),
    "glm cp2 a2a pp2": ("glm4_moe", {}, 1, False, 1, None, 2, "a2a", 2, torch.float64),
}
FAST = ("v3 tp2 sp fp32", "v3 tp2 ep2 etp1", "v3 cp2 a2a", "v3 pp2", "v3 no q latent yarn tp2 sp ep2", "v2 cp2 ring",
        "glm tp2 sp ep2")


def _reduce(t, group, dp):
    t = t.clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t / dp


def _tolerance(family, dtype):
    if dtype == torch.float32:
        return 1e-4
    # fp64 models: the routers' weights are fp32 on both sides (HF: and V2's RoPE, complex numbers in fp32)
    return 1e-7 if family == "deepseek_v2" else 1e-8


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
@distributed(world_size=4)
def test_deepseek_families_match_hugging_face(case):
    family, options, tp_size, sp, ep, etp, cp, cp_mode, pp, dtype = CASES[case]
    mesh = tp.init_mesh(tp=tp_size, cp=cp, ep=ep, etp=etp, pp=pp)
    hf = hf_deepseek(family, dtype=dtype, **options)
    torch.set_default_dtype(dtype)
    stage = stage_options(models.GPTConfig(num_layers=3), mesh)
    model = models.GPT.from_hf(hf, stage=stage, sequence_parallel=sp, cp_mode=cp_mode)
    g = rng(0)
    X = torch.randint(0, VOCAB, (mesh.dp_size * BATCH, SEQ), generator=g)
    Y = torch.randint(0, VOCAB, X.shape, generator=g)
    rows = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)
    out = hf(X)
    lm = F.cross_entropy(out.logits.reshape(-1, VOCAB), Y.reshape(-1))
    lm.backward()
    tol = _tolerance(family, dtype)
    if pp == 1:
        with torch.no_grad():
            err = (model(X[rows]) - out.logits[rows]).abs().max().item()
        assert err <= tol, f"logits err {err}"
        loss = model(X[rows], Y[rows])
        loss.backward()
    else:
        runner = tp.pipeline.PipelineRunner(model, mesh, micro_batch_size=BATCH, seq_len=SEQ)
        loss = torch.tensor(runner.run([(X[rows], Y[rows])], "1f1b").loss)
    assert abs(_reduce(loss.detach(), mesh.dp_group, mesh.dp_size).item() - lm.item()) <= max(tol, 1e-5), "loss"
    expected = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    ours = hf_state_dict(model, grads=True)
    assert ours and set(ours) <= set(expected), set(ours) - set(expected)
    if pp == 1:
        assert set(ours) == set(expected), set(ours) ^ set(expected)
    for name, grad in ours.items():
        group = mesh.edp_group if ".experts." in name else mesh.group("dp-cp")
        err = (_reduce(grad, group, mesh.dp_size) - expected[name]).abs().max().item()
        assert err <= tol * max(1.0, expected[name].abs().max().item()) * 10, f"{name} grad err {err}"


@pytest.mark.parametrize("family,options", [("deepseek_v3", {}), ("deepseek_v3", dict(q_lora=None, yarn=True)),
                                            ("deepseek_v2", {}), ("glm4_moe", {})])
@distributed(world_size=4)
def test_deepseek_round_trip_is_bit_exact_and_transformers_reads_it(family, options):
    """Saved by transformers -> our GPT at tp 2 x ep 2, each rank reading its experts -> save_hf -> the same
    tensors (the selection bias included), the same config; transformers' model of the export gives the same
    logits."""
    import shutil
    import tempfile


    mesh = tp.init_mesh(tp=2, ep=2)
    root = [tempfile.mkdtemp(prefix="tp-deepseek-roundtrip-") if mesh.rank == 0 else None]
    dist.broadcast_object_list(root)
    source, target = os.path.join(root[0], "source"), os.path.join(root[0], "target")
    hf = hf_deepseek(family, dtype=torch.float32, **options)
    if mesh.rank == 0:
        hf.save_pretrained(source)
    dist.barrier()
    model = models.GPT.from_hf(source)
    model.save_hf(target)
    dist.barrier()
    assert_same_safetensors(source, target)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(target, experts_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=rng(0))
    assert torch.equal(reloaded(x).logits, hf(x).logits)
    dist.barrier()
    if mesh.rank == 0:
        shutil.rmtree(root[0])


ALPHA = 0.05  # the sequence-wise loss's coefficient (large enough to matter in the gradients)


def _sequence_loss_reference(hf, x):
    """HF's forward on x [b, s] with DeepSeek-V3's sequence-wise balance loss summed over its MoE layers, computed by
    definition from what each router returned (logits, choices): (logits, the loss)."""
    routed = []
    hooks = [m.register_forward_hook(lambda mod, args, out: routed.append(out)) for m in hf.modules()
             if type(m).__name__.endswith("TopkRouter")]
    logits = hf(x).logits
    for hook in hooks:
        hook.remove()
    b, s = x.shape
    total = 0.0
    for router_logits, _, indices in routed:
        scores = router_logits.double().sigmoid().view(b, s, -1)
        E, k = scores.shape[-1], indices.shape[-1]
        probs = scores / scores.sum(-1, keepdim=True)
        counts = F.one_hot(indices.view(b, s * k), E).sum(1).double()  # [b, E]
        total = total + ALPHA * ((E / (k * s)) * counts * probs.mean(1)).sum(-1).mean()
    return logits, total


@distributed(world_size=4)
def test_sequence_wise_loss_is_hugging_faces_routing_by_definition():
    """tp 2 with SP x ep 2 (dp 2): the GPT's sequence-wise loss (value and gradient) equals the definition over HF's
    own routing (group-limited, biased) of each sequence of the global batch."""
    mesh = tp.init_mesh(tp=2, ep=2)
    hf = hf_deepseek("deepseek_v3")
    torch.set_default_dtype(torch.float64)
    model = models.GPT.from_hf(hf, sequence_parallel=True, moe_seq_aux_loss_coeff=ALPHA)
    g = rng(2)
    X = torch.randint(0, VOCAB, (mesh.dp_size * BATCH, SEQ), generator=g)
    Y = torch.randint(0, VOCAB, X.shape, generator=g)
    rows = slice(mesh.dp_rank * BATCH, (mesh.dp_rank + 1) * BATCH)
    logits, sequence = _sequence_loss_reference(hf, X)
    (F.cross_entropy(logits.reshape(-1, VOCAB), Y.reshape(-1)) + sequence).backward()
    model(X[rows], Y[rows]).backward()
    value = _reduce(model.moe_aux_losses()["sequence"].double(), mesh.dp_group, mesh.dp_size)
    assert abs(value.item() - sequence.item()) <= 1e-6, (value.item(), sequence.item())
    expected = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    for name, grad in hf_state_dict(model, grads=True).items():
        group = mesh.edp_group if ".experts." in name else mesh.group("dp-cp")
        err = (_reduce(grad, group, mesh.dp_size) - expected[name]).abs().max().item()
        assert err <= 1e-7 * max(1.0, expected[name].abs().max().item()), f"{name} grad err {err}"


@pytest.mark.parametrize("family,options", [("deepseek_v3", {}), ("glm4_moe", {}), ("deepseek_v2", {}),
                                            ("deepseek_v2", dict(q_lora=None))])
@distributed(world_size=2)
def test_tp_parallelize_runs_the_families_own_plans(family, options):
    """tp.parallelize(hf_model) at tp 2 with the config's own plan (DeepSeek-V3's: the MLPs and experts; GLM-4.5's:
    attention heads too; DeepSeek-V2's: the MLA heads, its kv down-projection `mla_kv_a_proj`, read as
    replicated_with_tail_grad_allreduce) gives the model's logits, loss and every gradient."""
    from .test_moe_parallelize import dense_grads

    tp.init_mesh(tp=2)
    reference = hf_deepseek(family, dtype=torch.float32, **options)
    hf = hf_deepseek(family, dtype=torch.float32, **options)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=rng(0))
    tp.parallelize(hf)
    if family == "deepseek_v2":
        assert "replicated_with_tail_grad_allreduce" in tp.describe(hf)
    expected, logits = reference(x, labels=x), hf(x, labels=x)
    assert (logits.logits - expected.logits).abs().max().item() <= 1e-5
    assert abs(logits.loss.item() - expected.loss.item()) <= 1e-6
    expected.loss.backward()
    logits.loss.backward()
    grads, reference_grads = dense_grads(hf), {n: p.grad for n, p in reference.named_parameters()}
    assert set(grads) == {n for n, g in reference_grads.items() if g is not None}
    for name, grad in grads.items():
        err = (grad - reference_grads[name]).abs().max().item()
        assert err <= 1e-5 * max(1.0, reference_grads[name].abs().max().item()), f"{name} grad err {err}"
