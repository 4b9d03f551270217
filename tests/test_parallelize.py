"""tp.parallelize on tiny Hugging Face models (random weights, built from their configs) against the dense model.

Every rank builds the dense model from one seed and parallelizes a deep copy. Compared (fp32, <= 1e-4): greedy
generation, logits and loss, every gradient (a sharded parameter's as this rank's slice of the dense gradient), the
collective counts, and the logits again after SGD steps on both. TP = 2 on 2 ranks, TP = 4 on 4 ranks; the head
counts make TP = 4 (and MQA at TP = 2) hold each kv head on several ranks.
"""
import copy
import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import tp  # noqa: E402
from tp import default_plan  # noqa: E402
from tp.parallelize import describe, parallelize  # noqa: E402
from tp.testing import distributed  # noqa: E402

from .helpers import (  # noqa: E402
    ALL_GATHER,
    ALL_REDUCE,
    GREEDY_MARGIN,
    REDUCE_SCATTER,
    assert_close,
    comm_counts,
    greedy_margin,
    rng,
)

ATOL = 1e-4
V, S, B, LAYERS = 64, 8, 2, 2
COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4, vocab_size=V,
              max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=0)
CONFIGS = {  # family: (config overrides, backward all-reduces per layer besides the replicated-kv sums)
    "llama": (dict(num_key_value_heads=2), 2),  # GQA; q, k, v share one input-grad all-reduce, gate and up another
    "mistral": (dict(num_key_value_heads=1, sliding_window=4), 2),  # MQA
    "qwen2": (dict(num_key_value_heads=4), 2),  # MHA, bias on q/k/v
    "qwen3": (dict(num_key_value_heads=2, head_dim=8), 4),  # + q_norm/k_norm grads summed over tp
    "gemma": (dict(num_key_value_heads=1, head_dim=8), 2),  # MQA, tied embeddings, sqrt(h)-scaled embeddings
    "gemma2": (dict(num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=1.0,
                    final_logit_softcapping=2.0), 2),  # soft-capping, sliding-window layers, eager attention
    "phi3": (dict(num_key_value_heads=2), 2),  # fused qkv (unequal parts under GQA) and gate_up (strided)
    "gpt2": (dict(n_embd=32, n_inner=48, n_layer=LAYERS, n_head=4, n_positions=32, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0), 2),  # Conv1D, fused q|k|v
}
FAMILIES = list(CONFIGS)


def tiny(family, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = CONFIGS[family][0] if family == "gpt2" else COMMON | CONFIGS.get(family, ({}, 0))[0]
    config = AutoConfig.for_model(family, **(fields | dict(vocab_size=V, bos_token_id=0, eos_token_id=1)) | overrides)
    torch.manual_seed(0)  # the same weights on every rank
    return AutoModelForCausalLM.from_config(config)


def tokens(seed):
    return torch.randint(0, V, (B, S), generator=rng(seed))


def expected_grad(model, dense, name):
    """This rank's slice of a dense parameter's gradient, in the parallel parameter's layout."""
    module_name, _, pname = name.rpartition(".")
    owner, grad = model.get_submodule(module_name), dense.get_parameter(name).grad
    if isinstance(owner, tp.VocabParallelEmbedding):
        return grad[owner.vocab_start:owner.vocab_end]
    if isinstance(owner, (tp.ColumnParallelLinear, tp.RowParallelLinear)):
        if type(dense.get_submodule(module_name)).__name__ == "Conv1D" and pname == "weight":
            grad = grad.t()  # Conv1D keeps [in, out]
        if pname == "bias" and isinstance(owner, tp.RowParallelLinear):
            return grad
        return owner.shard_dense(grad)
    return grad


def assert_grads_match(model, dense):
    for name, p in model.named_parameters():
        assert_close(p.grad, expected_grad(model, dense, name), ATOL, f"{name} grad")


def sgd_steps(models, ids, steps):
    """Step every model (grads already there) `steps` times with SGD on the same tokens."""
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(steps):
            if step:
                model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()


def assert_described(model):
    text = describe(model)
    for name, m in model.named_modules():
        if isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear, tp.VocabParallelEmbedding)):
            assert re.search(rf"^  {re.escape(name)} +(colwise|rowwise|vocab)", text, re.M), (name, text)


def check_against_dense(dense, model, *, logits_shard=lambda t: t, fwd=None, bwd=None):
    """Logits, loss, grads and collective counts of one step, then logits after two SGD steps."""
    ids = tokens(seed=1)
    out, fwd_counts = comm_counts(lambda: model(ids, labels=ids))
    ref = dense(ids, labels=ids)
    assert_close(out.logits, logits_shard(ref.logits.detach()), ATOL, "logits")
    assert_close(out.loss, ref.loss.detach(), ATOL, "loss")
    _, bwd_counts = comm_counts(lambda: out.loss.backward())
    ref.loss.backward()
    assert_grads_match(model, dense)
    for counts, expected in ((fwd_counts, fwd), (bwd_counts, bwd)):
        if expected is not None:
            assert counts == expected | {"total": sum(expected.values())}, (counts, expected)
    sgd_steps([model, dense], ids, steps=3)
    other = tokens(seed=2)
    assert_close(model(other).logits, logits_shard(dense(other).logits.detach()), ATOL, "logits after SGD")


def _all_reduces(n):
    return {ALL_REDUCE: n, ALL_GATHER: 0, REDUCE_SCATTER: 0}


def backward_all_reduces(family, config, tp_size):
    """Per model: each layer's column layers' input grads (+ Qwen3's norm grads), and, where kv heads < tp, the sum of
    the kv rows' grads over their replicas (one per fused qkv, one each for k_proj and v_proj)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    replica_sums = (1 if family == "phi3" else 2) * (kv_heads < tp_size)
    return LAYERS * (CONFIGS[family][1] + replica_sums) if tp_size > 1 else 0


def assert_full_state_dict(model, dense, fresh=None):
    """tp.full_state_dict gives the dense model's state dict back: same names, shapes and (trained) values; and
    tp.load_full_state_dict puts it into `fresh` (the model parallelized again, untrained) shard for shard."""
    full, expected = tp.full_state_dict(model), dense.state_dict()
    assert list(full) == list(expected)
    for name, tensor in expected.items():
        assert full[name].shape == tensor.shape, name
        assert_close(full[name], tensor, ATOL, f"full_state_dict[{name!r}]")
    if fresh is not None:
        assert any(not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
        tp.load_full_state_dict(fresh, full)
        for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(got, want), f"load_full_state_dict: {name}"


def check_family(family, tp_size):
    tp.init_mesh(tp=tp_size)
    dense = tiny(family)
    model = parallelize(copy.deepcopy(dense))
    assert model.config.num_attention_heads == dense.config.num_attention_heads  # the shared config is untouched
    prompt = tokens(seed=3)[:, :5]  # greedy decoding through HF's cache, with this rank's (kv) heads
    dense_run = dense.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    # each choice leads by more than twice ATOL, to which the logits agree (tests/helpers.py)
    assert greedy_margin(torch.stack(dense_run.logits, 1), dense_run.sequences[:, 5:],
                         eos=dense.generation_config.eos_token_id) >= GREEDY_MARGIN
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False), dense_run.sequences)
    check_against_dense(dense, model, fwd=_all_reduces(2 * LAYERS),
                        bwd=_all_reduces(backward_all_reduces(family, dense.config, tp_size)))
    assert_described(model)
    # after the SGD steps: fused parts, replicated kv rows, Conv1D layout; and back into an untrained model
    assert_full_state_dict(model, dense, fresh=parallelize(tiny(family)))
    kv_heads = getattr(dense.config, "num_key_value_heads", None) or 4
    heads = rf"{4 // tp_size} heads, {kv_heads * max(1, tp_size // kv_heads) // tp_size} kv heads per rank"
    assert len(re.findall(heads, describe(model))) == LAYERS, describe(model)
    if dense.config.tie_word_embeddings:  # default plan: both stay whole, still one parameter
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if family == "phi3":  # HF's own plan: fused outputs gathered, whole heads on every rank
        hf_plan = {f"model.{k}": v for k, v in dense.config.base_model_tp_plan.items()}
        check_against_dense(tiny(family), parallelize(tiny(family), hf_plan))


@pytest.mark.parametrize("family", FAMILIES)
@distributed(world_size=2)
def test_family_matches_dense_tp2(family):
    check_family(family, 2)


@pytest.mark.parametrize("family", FAMILIES)
@distributed(world_size=4)
def test_family_matches_dense_tp4(family):
    check_family(family, 4)


@pytest.mark.parametrize("family,head_style", [("llama", "colwise"), ("gemma", "colwise"),
                                               ("gpt2", "colwise_gather_output")])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_vocab_parallel_embedding_and_head(tp_size, family, head_style):
    """Embedding 'vocab' and lm_head colwise: local logits with HF's loss replaced by the vocab-parallel one, or
    gathered logits; a tied pair (gemma, gpt2) stays one parameter."""
    mesh = tp.init_mesh(tp=tp_size)
    dense = tiny(family)
    embedding = "transformer.wte" if family == "gpt2" else "model.embed_tokens"
    plan = default_plan(dense) | {embedding: "vocab", "lm_head": head_style}
    model = parallelize(copy.deepcopy(dense), plan)
    assert isinstance(model.get_input_embeddings(), tp.VocabParallelEmbedding)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == dense.config.tie_word_embeddings
    local = head_style == "colwise"
    shard = (lambda t: t.chunk(tp_size, -1)[mesh.tp_rank]) if local else (lambda t: t)
    # forward: 2 per layer + the embedding's, and one all-gather (the gathered logits, or the vocab-parallel loss's
    # statistics); backward: + the head's input grad
    fwd = 2 * LAYERS + 1 if tp_size > 1 else 0
    bwd = backward_all_reduces(family, dense.config, tp_size) + (tp_size > 1)
    gathers = int(tp_size > 1)
    check_against_dense(dense, model, logits_shard=shard,
                        fwd={ALL_REDUCE: fwd, ALL_GATHER: gathers, REDUCE_SCATTER: 0}, bwd=_all_reduces(bwd))
    assert ("loss_function" in describe(model)) == local
    assert_full_state_dict(model, dense, fresh=parallelize(tiny(family), plan))
    if local:  # greedy decoding over this rank's slice of the vocabulary would be silently wrong
        with pytest.raises(RuntimeError, match="generate\\(\\) needs full-vocabulary logits"):
            model.generate(tokens(seed=3), max_new_tokens=2)


@distributed(world_size=2)
def test_full_state_dict_of_a_model_around_the_parallelized_one():
    """parallelize on the base model (GPT-2's transformer, Conv1D layers), full_state_dict on the whole model: the
    dense names and [in, out] layouts."""
    tp.init_mesh(tp=2)
    dense = tiny("gpt2")
    model = copy.deepcopy(dense)
    parallelize(model.transformer, {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise",
                                    "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"})
    full = tp.full_state_dict(model)
    assert list(full) == list(dense.state_dict())
    for name, tensor in dense.state_dict().items():
        assert torch.equal(full[name], tensor), name


@distributed(world_size=2)
def test_load_full_state_dict_takes_a_tied_weight_once_and_refuses_a_wrong_shape():
    """safetensors keeps one name of a tied pair: the other is filled from it (strict load); a dense tensor of
    another shape is one line naming its key (index_select would have taken a wrong slice silently)."""
    tp.init_mesh(tp=2)
    plan = default_plan(tiny("gemma")) | {"model.embed_tokens": "vocab", "lm_head": "colwise"}
    model = parallelize(tiny("gemma"), plan)
    full = tp.full_state_dict(model)
    del full["lm_head.weight"]
    fresh = parallelize(tiny("gemma", initializer_range=0.5), plan)
    tp.load_full_state_dict(fresh, full)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    key = "model.layers.0.self_attn.o_proj.weight"
    wide = full | {key: torch.cat([full[key], full[key]], dim=1)}
    with pytest.raises(ValueError, match=rf"^load_full_state_dict: {re.escape(key)} has shape \(32, 64\), the dense "
                                         r"RowParallelLinear's is \(32, 32\)$"):
        tp.load_full_state_dict(fresh, wide)


@distributed(world_size=2)
def test_gpt_from_a_parallelized_hf_model_reads_its_dense_weights():
    """models.GPT.from_hf of an HF model tp.parallelize has split: the GPT's logits are those of the GPT built from
    the model before the split (from_hf read each local shard as if it were the dense tensor: off by ~0.4)."""
    import models

    tp.init_mesh(tp=2)
    dense = tiny("llama")
    want = models.GPT.from_hf(dense)
    got = models.GPT.from_hf(parallelize(copy.deepcopy(dense)))
    x = tokens(seed=5)
    assert torch.equal(got(x), want(x))


@distributed(world_size=4)
def test_full_state_dict_and_save_pretrained_under_fsdp2(tmp_path):
    """tp 2 x dp 2, FSDP2 over dp on each layer and the model (docs/optim.md's way): full_state_dict gathers each
    DTensor over dp, then the shards over tp (it raised "c10d.allgather_ ... no sharding strategy"), and
    save_pretrained writes the dense model. parallelize after fully_shard and load_full_state_dict after it are one
    line each (torch's "mixed torch.Tensor and DTensor")."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    mesh = tp.init_mesh(tp=2, dp=2)
    dense = tiny("llama")
    model = parallelize(copy.deepcopy(dense))
    with tp.optim.keep_param_tags(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh.device_mesh["dp"])
        fully_shard(model, mesh=mesh.device_mesh["dp"])
    full = tp.full_state_dict(model)
    assert list(full) == list(dense.state_dict())
    for name, tensor in dense.state_dict().items():
        assert torch.equal(full[name], tensor), name
    with pytest.raises(ValueError, match=r"^load_full_state_dict: model.embed_tokens.weight is FSDP2's DTensor: load "
                                         r"the dense state dict before fully_shard"):
        tp.load_full_state_dict(model, full)
    sharded_first = tiny("llama")
    fully_shard(sharded_first, mesh=mesh.device_mesh["dp"])
    with pytest.raises(ValueError, match=r"^tp.parallelize: model.embed_tokens.weight is already a DTensor \(FSDP2's "
                                         r"fully_shard\?\): parallelize first, then fully_shard"):
        parallelize(sharded_first)
    path = tmp_path / "saved"  # (each rank's own tmp_path: every dp rank 0 of its tp rank writes its own)
    model.save_pretrained(path, is_main_process=mesh.dp_rank == 0)
    if mesh.dp_rank == 0 and mesh.tp_rank == 0:
        for name, tensor in AutoModelForCausalLM.from_pretrained(path).state_dict().items():
            assert torch.equal(tensor, dense.state_dict()[name]), name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@distributed(world_size=2)
def test_save_pretrained_writes_the_trained_dense_model(family, tmp_path):
    """A trained parallelized model (and a deep copy of it) saves with HF's save_pretrained: every rank calls it,
    tp rank 0 writes the gathered weights, and from_pretrained loads the dense model the training produced."""
    from transformers import AutoModelForCausalLM

    tp.init_mesh(tp=2)
    dense = tiny(family)
    embedding = "transformer.wte" if family == "gpt2" else "model.embed_tokens"
    model = parallelize(copy.deepcopy(dense), default_plan(dense) | {embedding: "vocab", "lm_head": "colwise"})
    ids = tokens(seed=1)
    for m in (model, dense):
        m(ids, labels=ids).loss.backward()
    sgd_steps([model, dense], ids, steps=2)
    twin = copy.deepcopy(model)
    for m, path in ((model, tmp_path / "model"), (twin, tmp_path / "twin")):
        m.save_pretrained(path)
        torch.distributed.barrier()
        assert (path / "config.json").exists()
        loaded = AutoModelForCausalLM.from_pretrained(path)
        assert_close(loaded(tokens(seed=2)).logits, dense(tokens(seed=2)).logits.detach(), ATOL, f"{path} logits")
    with pytest.raises(ValueError, match="the dense state dict is gathered here"):
        model.save_pretrained(tmp_path / "other", state_dict=model.state_dict())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@distributed(world_size=2)
def test_attention_dropout_masks_are_per_rank(family):
    """In training, attention dropout over this rank's heads draws its own masks (Megatron's per-tp-rank stream),
    while the replicated stream (GPT-2's residual dropout after c_proj) stays shared: logits equal on both ranks.
    The same default-generator state gives the same step (recompute-safe); without a seeded stream it raises."""
    tp.init_mesh(tp=2)
    drop = dict(attn_pdrop=0.5, resid_pdrop=0.3) if family == "gpt2" else dict(attention_dropout=0.5)
    model = parallelize(tiny(family, attn_implementation="eager", **drop)).train()
    ids = tokens(seed=1)
    tp.get_rng_tracker().reset()
    with pytest.raises(RuntimeError, match=r"per-rank masks: .*tp.model_parallel_seed"):
        model(ids)
    tp.model_parallel_seed(0)
    out = model(ids, output_attentions=True)
    dropped = [torch.empty_like(out.attentions[0], dtype=torch.bool) for _ in range(2)]  # [b, heads/tp, s, s]
    torch.distributed.all_gather(dropped, out.attentions[0] == 0)
    assert dropped[0].float().mean() > 0.3 and not torch.equal(dropped[0], dropped[1])
    logits = [torch.empty_like(out.logits) for _ in range(2)]
    torch.distributed.all_gather(logits, out.logits.detach())
    assert torch.equal(logits[0], logits[1])
    torch.manual_seed(5)
    first = model(ids).logits
    torch.manual_seed(5)
    assert torch.equal(model(ids).logits, first)


@distributed(world_size=2)
def test_debug_mode_names_the_layer_whose_replicated_input_differs():
    """TP_DEBUG on a parallelized model: a norm weight that drifted on one rank makes q_proj's input differ; the
    error names the layer, on every rank."""
    mesh = tp.init_mesh(tp=2)
    model = parallelize(tiny("llama"))
    if mesh.tp_rank == 1:
        with torch.no_grad():
            model.model.layers[0].input_layernorm.weight[0] += 1e-3
    with tp.set_debug(True), pytest.raises(ValueError, match=r"the input of model\.layers\.0\.self_attn\.q_proj "
                                                              r"should be replicated but differs"):
        model(tokens(seed=1))


REFUSALS = [  # (family, config overrides, plan or None, keyword arguments, what the message must name)
    ("llama", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=6), None, {},
     "num_attention_heads = 6 is not divisible by tp = 4"),
    ("llama", dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=3), None, {},
     "num_key_value_heads = 3 is neither divisible by tp nor a divisor of it"),
    ("gpt2", dict(n_head=2), None, {}, "num_attention_heads = 2 is not divisible by tp = 4"),
    ("llama", dict(intermediate_size=50), None, {}, "out_features = 50 is not divisible"),
    ("llama", {}, {"model.layers.*.mlp.down_proj": "sequence_parallel"}, {}, "unknown style 'sequence_parallel'"),
    ("llama", {}, {"model.layers.*.mlp.nope": "colwise"}, {}, "'model.layers.*.mlp.nope' matches no module"),
    ("llama", {}, {"model.norm": "colwise"}, {}, "model.norm is LlamaRMSNorm; style 'colwise' needs nn.Linear"),
    ("llama", dict(vocab_size=66), {"model.embed_tokens": "vocab"}, {}, "num_embeddings = 66 is not divisible"),
    ("llama", {}, {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}, {},
     "model.layers.0.self_attn.k_proj is not sharded but must be 'colwise'"),
    ("gemma", {}, {"lm_head": "colwise"}, {}, "lm_head.weight is tied to model.embed_tokens"),
    ("llama", {}, {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise"}, {},
     "model.layers.0.mlp.gate_proj is 'colwise' (output [..., out/tp]) but no layer beside it in "
     "model.layers.0.mlp is 'rowwise'"),
    ("llama", {}, {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.*_proj": "rowwise"}, {},
     "model.layers.0.mlp.up_proj matches 'model.layers.*.mlp.up_proj' (colwise) and 'model.layers.*.mlp.*_proj'"),
    ("llama", {}, None, dict(sequence_parallel=True), "sequence_parallel=True is not supported"),
    ("llama", {}, {"model.layers.*.self_attn.k_proj": "replicated_with_tail_grad_allreduce"}, {},
     "model.layers.0.self_attn.k_proj: replicated_with_tail_grad_allreduce sums the gradient of the output's last "
     "config.qk_rope_head_dim features, and LlamaForCausalLM has no config.qk_rope_head_dim"),
    ("granite", dict(num_key_value_heads=2), None, {},  # a family tp has not checked: kv heads never replicated
     "num_key_value_heads = 2 < tp and replicating kv heads is not verified"),
    ("llama", {}, ["colwise"], {}, "plan=['colwise'] must be a dict {module name pattern: style} (or None: the "
                                   "family's default plan)"),
]


@distributed(world_size=4)
def test_refusals_leave_the_model_untouched():
    """Each bad split raises ValueError on every rank, naming the bad value, before any module is replaced."""
    tp.init_mesh(tp=4)
    for family, overrides, plan, kwargs, message in REFUSALS:
        model = tiny(family, **overrides)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        modules = [type(m) for m in model.modules()]
        with pytest.raises(ValueError, match=re.escape(message)), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the unchecked family's warning)
            parallelize(model, plan, **kwargs)
        assert [type(m) for m in model.modules()] == modules, message
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), message
        assert describe(model).endswith("not parallelized by tp.parallelize")
    model = parallelize(tiny("llama"))
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize(model)


@distributed(world_size=2)
def test_unchecked_family_follows_hf_plan_with_a_warning():
    """A family outside tp's checked list (Granite: Llama-like with multipliers) runs its own plan, with a warning."""
    tp.init_mesh(tp=2)
    dense = tiny("granite", num_key_value_heads=2)
    with pytest.warns(UserWarning, match="'granite' is not among the families tp checked"):
        model = parallelize(copy.deepcopy(dense))
    check_against_dense(dense, model, fwd=_all_reduces(2 * LAYERS), bwd=_all_reduces(2 * LAYERS))


@distributed(world_size=2)
def test_plain_module_plan():
    """Any nn.Module with a plan: a Column -> GELU -> Row MLP out of nn.Sequential, same output and grads."""
    tp.init_mesh(tp=2)
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 6))
    model = parallelize(copy.deepcopy(dense), {"0": "colwise", "2": "rowwise"})
    assert isinstance(model[0], tp.ColumnParallelLinear) and isinstance(model[2], tp.RowParallelLinear)
    x = torch.randn(3, 5, 6, generator=rng(1))
    assert_close(model(x), dense(x), 1e-6, "output")
    model(x).square().sum().backward()
    dense(x).square().sum().backward()
    assert_grads_match(model, dense)
    assert_described(model)


@distributed(world_size=2)
def test_describe_a_container_lists_its_parallelized_submodules():
    tp.init_mesh(tp=2)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"mlp": torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(),
                                                             torch.nn.Linear(10, 6)), "head": torch.nn.Linear(6, 3)})
    parallelize(model["mlp"], {"0": "colwise", "2": "rowwise"})
    text = describe(model)
    assert text.startswith("ModuleDict: parallelized inside: mlp") and "colwise" in text and "rowwise" in text, text
    assert describe(torch.nn.Linear(2, 2)) == "Linear: not parallelized by tp.parallelize"


@distributed(world_size=2)
def test_a_wrong_kind_error_names_the_hf_style_written():
    tp.init_mesh(tp=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"0 is Linear; style 'vocab' \(HF's 'embedding_rowwise'\) needs nn.Embedding"):
        parallelize(model, {"0": "embedding_rowwise"})
