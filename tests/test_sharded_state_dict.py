"""tp.sharded_state_dict with torch's DCP: a parallelized model's checkpoint holds the dense tensors (each block
written once), loads at another tp / ep / etp split, into the dense model, under FSDP2, and from the dense model's
own checkpoint; every load compared exactly with the dense model's trained weights."""
import copy
import functools
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("transformers")

import tp  # noqa: E402
from tp.testing import distributed  # noqa: E402

from .test_moe_hf import hf_moe  # noqa: E402
from .test_parallelize import tiny, tokens  # noqa: E402

tiny_model = tiny


def trained(model, seed=7):
    """`model` with every parameter moved off its initial values (a seeded step), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def assert_holds(model, dense, what):
    """The parallelized (or dense) `model` holds exactly `dense`'s weights (a collective when parallelized)."""
    got = tp.full_state_dict(model)
    for name, tensor in dense.state_dict().items():
        assert torch.equal(got[name], tensor), f"{what}: {name}"


def assert_dense_checkpoint(path, dense):
    """The checkpoint stores every tensor at its dense shape, each element once (a kv row several ranks hold too)."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, tensor in dense.state_dict().items():
        assert tuple(stored[name].size) == tuple(tensor.shape), name
        assert sum(math.prod(c.sizes) for c in stored[name].chunks) == tensor.numel(), name


@pytest.mark.parametrize("family,overrides", [  # (phi3 GQA's unequal parts: its MQA case has them too)
    ("llama", {}), ("phi3", {"num_key_value_heads": 1}), ("gpt2", {}),
    pytest.param("phi3", {}, marks=pytest.mark.slow), pytest.param("gemma", {}, marks=pytest.mark.slow)])
@distributed(world_size=4)
def test_a_dcp_checkpoint_reshards_to_any_tp_and_to_the_dense_model(family, overrides, tmp_path):
    """Saved at tp 2 (x dp 2: replicas); loaded at tp 4 (kv rows on two ranks each; phi3: unequal fused qkv parts,
    and with one kv head a rank's q rows that run on into k and v, which DCP refused as overlapping chunks; gpt2:
    Conv1D [in, out], fused q|k|v) and into the dense model; the dense model's own checkpoint loaded at tp 2."""
    tp.init_mesh(tp=2)
    tiny = functools.partial(tiny_model, **overrides)
    dense = trained(tiny(family))
    model = tp.parallelize(copy.deepcopy(dense))
    dcp.save(tp.sharded_state_dict(model), checkpoint_id=tmp_path / "tp2")
    assert_dense_checkpoint(tmp_path / "tp2", dense)

    tp.destroy_mesh(keep_groups=True)
    tp.init_mesh(tp=4)
    fresh = tp.parallelize(tiny(family))
    dcp.load(tp.sharded_state_dict(fresh), checkpoint_id=tmp_path / "tp2")
    assert_holds(fresh, dense, "tp 2 -> tp 4")
    dense_again = tiny(family)
    dcp.load(dense_again.state_dict(), checkpoint_id=tmp_path / "tp2")
    assert_holds(dense_again, dense, "tp 2 -> dense")

    dcp.save(dense.state_dict(), checkpoint_id=tmp_path / "dense")
    tp.destroy_mesh(keep_groups=True)
    tp.init_mesh(tp=2)
    fresh = tp.parallelize(tiny(family))
    dcp.load(tp.sharded_state_dict(fresh), checkpoint_id=tmp_path / "dense")
    assert_holds(fresh, dense, "dense -> tp 2")


@pytest.mark.filterwarnings("ignore:tp.parallelize")
@distributed(world_size=4)
def test_moe_experts_reshard_across_ep_and_etp(tmp_path):
    """Qwen2-MoE (shared expert, experts' gate|up rows split over etp) saved at tp 2 x ep 2 x etp 1, loaded at tp 4
    x ep 2 x etp 2 and at tp 1 x ep 4, and into the dense model."""
    tp.init_mesh(tp=2, ep=2, etp=1)
    dense = trained(hf_moe("qwen2_moe", experts=4))
    model = tp.parallelize(copy.deepcopy(dense))
    dcp.save(tp.sharded_state_dict(model), checkpoint_id=tmp_path)
    assert_dense_checkpoint(tmp_path, dense)
    for split in (dict(tp=4, ep=2, etp=2), dict(tp=1, ep=4)):
        tp.destroy_mesh(keep_groups=True)
        tp.init_mesh(**split)
        fresh = tp.parallelize(hf_moe("qwen2_moe", experts=4))
        dcp.load(tp.sharded_state_dict(fresh), checkpoint_id=tmp_path)
        assert_holds(fresh, dense, f"tp 2 x ep 2 -> {split}")
    dense_again = hf_moe("qwen2_moe", experts=4)
    dcp.load(dense_again.state_dict(), checkpoint_id=tmp_path)
    assert_holds(dense_again, dense, "tp 2 x ep 2 -> dense")


def fsdp2_model(mesh, dense):
    """`dense` copied, parallelized over the mesh's tp group and sharded by FSDP2 over its dp group per layer."""
    from torch.distributed.fsdp import fully_shard

    model = tp.parallelize(copy.deepcopy(dense))
    with tp.optim.keep_param_tags(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh.device_mesh["dp"])
        fully_shard(model, mesh=mesh.device_mesh["dp"])
    return model


@distributed(world_size=4)
def test_under_fsdp2_each_rank_saves_and_loads_its_dp_shard_of_its_tp_shard(tmp_path):
    """tp 2 x dp 2 with FSDP2 per layer: the checkpoint is the dense model's; it loads in place into another FSDP2
    model at the same split and into a plain tp 4 one."""
    mesh = tp.init_mesh(tp=2, dp=2)
    dense = trained(tiny("llama"))
    dcp.save(tp.sharded_state_dict(fsdp2_model(mesh, dense)), checkpoint_id=tmp_path)
    assert_dense_checkpoint(tmp_path, dense)
    fresh = fsdp2_model(mesh, tiny("llama"))
    dcp.load(tp.sharded_state_dict(fresh), checkpoint_id=tmp_path)
    assert_holds(fresh, dense, "fsdp2 -> fsdp2")
    tp.destroy_mesh(keep_groups=True)
    tp.init_mesh(tp=4)
    fresh = tp.parallelize(tiny("llama"))
    dcp.load(tp.sharded_state_dict(fresh), checkpoint_id=tmp_path)
    assert_holds(fresh, dense, "fsdp2 tp 2 x dp 2 -> tp 4")


def adamw_steps(model, optimizer, steps, seed=11):
    """`steps` AdamW steps of the language-model loss on one batch per step (the same on every rank)."""
    for step in range(steps):
        x = tokens(seed + step)
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@distributed(world_size=4)
def test_the_optimizer_state_resumes_at_the_same_split_exactly_and_at_another_or_dense(tmp_path):
    """tp.ShardedOptimizerState beside the model in one DCP checkpoint (AdamW after 2 steps at tp 2): a fresh
    optimizer (no state yet) resumes the third step bit for bit at tp 2, and to fp32 rounding at tp 4 and densely."""
    tp.init_mesh(tp=2)
    model = tp.parallelize(tiny("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    adamw_steps(model, optimizer, 2)
    dcp.save({"model": tp.sharded_state_dict(model), "optim": tp.ShardedOptimizerState(model, optimizer)},
             checkpoint_id=tmp_path)
    stored = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    key = "optim.state.model.layers.0.self_attn.k_proj.weight.exp_avg"  # (kv rows on two ranks at tp 4)
    assert tuple(stored[key].size) == (16, 32)
    adamw_steps(model, optimizer, 1, seed=13)
    want = tp.full_state_dict(model)

    for split, exact in ((2, True), (4, False), (None, False)):
        tp.destroy_mesh(keep_groups=True)
        tp.init_mesh(tp=split or 1)
        fresh = tp.parallelize(tiny("llama")) if split else tiny("llama")
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5, weight_decay=0.0)  # (loaded over)
        state = {"model": tp.sharded_state_dict(fresh), "optim": tp.ShardedOptimizerState(fresh, fresh_optimizer)}
        dcp.load(state, checkpoint_id=tmp_path)
        assert fresh_optimizer.param_groups[0]["lr"] == 1e-2 and fresh_optimizer.param_groups[0]["weight_decay"] == 0.1
        adamw_steps(fresh, fresh_optimizer, 1, seed=13)
        got = tp.full_state_dict(fresh) if split else fresh.state_dict()
        for name, tensor in want.items():
            if exact:
                assert torch.equal(got[name], tensor), f"tp {split}: {name}"
            else:
                torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=f"tp {split}: {name}")
    zero1 = tp.optim.DistributedOptimizer(tp.optim.DataParallel(fresh))
    with pytest.raises(TypeError, match="^ShardedOptimizerState takes a torch optimizer over the module's parameters"):
        tp.ShardedOptimizerState(fresh, zero1)


@distributed(world_size=2)
def test_blocks_in_torchs_checkpoint_wrapper_keep_their_state_dict_names(tmp_path):
    """torchtitan's activation checkpointing wraps each block (checkpoint_wrapper): the module names gain
    `_checkpoint_wrapped_module.`, the state dict's do not. Every tp parameter is still found by its state-dict name
    (it was skipped: local shards saved as the dense tensors, silently)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    tp.init_mesh(tp=2)
    dense = trained(tiny("llama"))
    model = tp.parallelize(copy.deepcopy(dense))
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    assert_holds(model, dense, "full_state_dict")
    optimizer = torch.optim.AdamW(model.parameters())
    dcp.save({"model": tp.sharded_state_dict(model), "optim": tp.ShardedOptimizerState(model, optimizer)},
             checkpoint_id=tmp_path)
    stored = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    for name, tensor in dense.state_dict().items():
        assert tuple(stored[f"model.{name}"].size) == tuple(tensor.shape), name
        if name in dict(dense.named_parameters()):
            assert tuple(stored[f"optim.state.{name}.exp_avg"].size) == tuple(tensor.shape), name
    fresh = tiny("llama")
    dcp.load({"model": fresh.state_dict()}, checkpoint_id=tmp_path)
    assert_holds(fresh, dense, "into the dense model")


@distributed(world_size=2)
def test_the_optimizer_state_of_a_ddp_model_and_state_it_cannot_reshard():
    """torch DDP's prefix is not in the optimizer state dict's names (nor compile's): the tp parameters are still
    found by identity (they were not: their local moments saved as the dense ones, silently); Adafactor's row and
    column statistics, shaped otherwise than the parameter, are refused."""
    from torch.distributed.tensor import DTensor

    mesh = tp.init_mesh(tp=2)
    model = torch.nn.parallel.DistributedDataParallel(tp.parallelize(tiny("llama")), process_group=mesh.dp_group)
    optimizer = torch.optim.AdamW(model.parameters())
    state = tp.ShardedOptimizerState(model, optimizer).state_dict()
    key = "state.model.layers.0.self_attn.q_proj.weight.exp_avg"
    assert isinstance(state[key], DTensor) and tuple(state[key].shape) == (32, 32)
    adafactor = torch.optim.Adafactor(model.parameters())
    adamw_steps(model, adafactor, 1)
    with pytest.raises(ValueError, match=r"^ShardedOptimizerState: model\.layers\.0\.self_attn\.q_proj\.weight's "
                                         r"'(row|col)_var' has shape"):
        tp.ShardedOptimizerState(model, adafactor).state_dict()


def assert_resumes_at_tp_4(path, want):
    """The model and AdamW state checkpointed at `path` (after 2 steps), loaded at tp 4 into a fresh model and
    optimizer, take the third step to `want` (the weights after it, fp32 rounding)."""
    tp.destroy_mesh(keep_groups=True)
    tp.init_mesh(tp=4)
    fresh = tp.parallelize(tiny("llama"))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # (loaded over)
    dcp.load({"model": tp.sharded_state_dict(fresh), "optim": tp.ShardedOptimizerState(fresh, fresh_optimizer)},
             checkpoint_id=path)
    adamw_steps(fresh, fresh_optimizer, 1, seed=13)
    got = tp.full_state_dict(fresh)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def pipeline_stage(model, stage):
    """`model` cut to pipeline stage `stage` of 2 as torchtitan cuts it: the other stage's modules gone, the kept
    layers under their own names (stage 0: the embedding and layer 0; stage 1: layer 1, the norm and the head)."""
    inner = model.model
    if stage == 0:
        inner.layers[1], inner.norm, model.lm_head = torch.nn.Identity(), None, None
    else:
        inner.layers[0], inner.embed_tokens = torch.nn.Identity(), None
    return model


@distributed(world_size=4)
def test_pipeline_stages_save_their_own_optimizer_state_into_one_checkpoint(tmp_path):
    """tp 2 x pp 2: each stage saves its own parameters' AdamW state (torch's flattened names, no collision between
    stages' param_groups); the checkpoint resumes at tp 4 without pipeline parallelism as the unsplit run steps."""
    mesh = tp.init_mesh(tp=2, pp=2)
    model = tp.parallelize(tiny("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    adamw_steps(model, optimizer, 2)
    stage = pipeline_stage(model, mesh.pp_rank)
    stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.1)
    stage_optimizer.state.update({p: optimizer.state[p] for p in stage.parameters()})  # (what the stage trained)
    dcp.save({"model": tp.sharded_state_dict(stage), "optim": tp.ShardedOptimizerState(stage, stage_optimizer)},
             checkpoint_id=tmp_path)

    tp.destroy_mesh(keep_groups=True)
    tp.init_mesh(tp=2)
    unsplit = tp.parallelize(tiny("llama"))
    unsplit_optimizer = torch.optim.AdamW(unsplit.parameters(), lr=1e-2, weight_decay=0.1)
    adamw_steps(unsplit, unsplit_optimizer, 3)
    want = tp.full_state_dict(unsplit)
    assert_resumes_at_tp_4(tmp_path, want)


@distributed(world_size=4)
def test_fsdp2_optimizer_state_resumes_at_tp_4(tmp_path):
    """tp 2 x dp 2 under FSDP2: each rank saves AdamW's state of its dp shard of its tp shard; it resumes at tp 4
    (no FSDP2) as the run without FSDP2 steps."""
    mesh = tp.init_mesh(tp=2, dp=2)
    model = fsdp2_model(mesh, tiny("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    adamw_steps(model, optimizer, 2)
    dcp.save({"model": tp.sharded_state_dict(model), "optim": tp.ShardedOptimizerState(model, optimizer)},
             checkpoint_id=tmp_path)
    adamw_steps(model, optimizer, 1, seed=13)
    want = tp.full_state_dict(model)
    assert_resumes_at_tp_4(tmp_path, want)
