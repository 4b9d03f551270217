"""The GPT against Hugging Face's models: logits, loss, every gradient and a few SGD steps, at TP = 1, 2, 4 with and
without sequence parallelism; collective counts; init, dropout, recomputation; HF weights in and out."""
import os

import pytest
import torch
import torch.nn.functional as F

import models
import tp
from kernels.linear import KEPT_BY_PRODUCER
from models.hf import hf_state_dict
from tp.testing import distributed

from .helpers import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, assert_close, comm_counts, rng

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 50, 8, 2  # no tp divides the vocabulary; the sequence splits across 4 ranks


def hf_model(family, kv_heads, seed=0):
    """A tiny HF causal LM with random weights (no download), in eval mode (no dropout)."""
    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[family]
        config = cls(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, head_dim=4,
                     num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
                     tie_word_embeddings=family == "qwen2")
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tokens(seed):
    g = rng(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def hf_loss(hf, x, y):
    logits = hf(x).logits
    return logits, F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


# kv heads 1 (MQA), 2 and 4 of 4 query heads: fewer than, equal to and more than tp across TP = 1, 2, 4.
FAMILIES = [("llama", 1), ("mistral", 2), ("qwen2", 4), ("gpt2", 4)]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("family,kv_heads", FAMILIES)
@distributed(world_size=4)
def test_gpt_matches_hugging_face(family, kv_heads, tp_size):
    tp.init_mesh(tp=tp_size)
    for sequence_parallel in (False, True):
        hf = hf_model(family, kv_heads)
        model = models.GPT.from_hf(hf, sequence_parallel=sequence_parallel)
        hf_opt, opt = torch.optim.SGD(hf.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(3):
            x, y = tokens(step)
            hf_logits, expected = hf_loss(hf, x, y)
            loss = model(x, y)
            assert abs(loss.item() - expected.item()) <= 1e-5, (sequence_parallel, step, loss.item(), expected.item())
            if step == 0:
                err = (model(x) - hf_logits).abs().max().item()
                assert err <= 1e-4, f"logits err {err} (sp={sequence_parallel})"
            hf_opt.zero_grad(), opt.zero_grad()
            expected.backward()
            loss.backward()
            if step == 0:  # every gradient, gathered over tp, under HF's names
                reference = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
                ours = hf_state_dict(model, grads=True)
                assert set(ours) == set(reference), set(reference) ^ set(ours)
                for name, grad in ours.items():
                    err = (grad - reference[name]).abs().max().item()
                    assert err <= 1e-5, f"{name} grad err {err} (sp={sequence_parallel})"
            hf_opt.step(), opt.step()


def _block_counts(config, mesh, x):
    torch.manual_seed(0)
    block = models.TransformerBlock(config)
    x = x.chunk(mesh.tp_size)[mesh.tp_rank] if config.sequence_parallel else x
    x = x.clone().requires_grad_()
    y, fwd = comm_counts(lambda: block(x))
    _, bwd = comm_counts(lambda: y.sum().backward())
    return fwd, bwd


@pytest.mark.parametrize("sequence_parallel", [False, True])
@distributed(world_size=4)
def test_collective_counts_per_block_and_model(sequence_parallel):
    mesh = tp.init_mesh(tp=4)
    x = torch.randn(SEQ, BATCH, 16)
    for kv_heads, bias in ((4, False), (2, True)):  # kv heads sharded / replicated (+1 all-reduce of their grads)
        config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_heads=4, num_kv_heads=kv_heads,
                                  ffn_hidden_size=24, bias=bias, sequence_parallel=sequence_parallel)
        fwd, bwd = _block_counts(config, mesh, x)
        replicas = int(kv_heads < 4)
        if sequence_parallel:  # forward: 2 AG + 2 RS; backward: 2 input re-gathers + 2 row AG, 2 RS, and the
            # grads of the 2 norms (+ the 2 row biases) summed over tp
            assert (fwd[ALL_GATHER], fwd[REDUCE_SCATTER], fwd["total"]) == (2, 2, 4), fwd
            assert (bwd[ALL_GATHER], bwd[REDUCE_SCATTER], bwd[ALL_REDUCE]) == (4, 2, 2 + 2 * bias + replicas), bwd
        else:  # one all-reduce per column->row pair each way
            assert (fwd[ALL_REDUCE], fwd["total"]) == (2, 2), fwd
            assert (bwd[ALL_REDUCE], bwd["total"]) == (2 + replicas, 2 + replicas), bwd
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_heads=4, ffn_hidden_size=24, num_layers=2,
                              sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    model = models.GPT(config)
    x, y = tokens(0)
    loss, fwd = comm_counts(lambda: model(x, y))
    _, bwd = comm_counts(lambda: loss.backward())
    if sequence_parallel:  # embedding RS, 2 blocks, output AG; loss: 1 AG
        assert (fwd[ALL_GATHER], fwd[REDUCE_SCATTER], fwd[ALL_REDUCE]) == (6, 5, 0), fwd
        # embedding AG, blocks (4 AG + 2 RS + 2 AR each), final norm AR, output re-gather AG + RS
        assert (bwd[ALL_GATHER], bwd[REDUCE_SCATTER], bwd[ALL_REDUCE]) == (10, 5, 5), bwd
    else:  # embedding AR, 2 per block, loss 1 AG | output dx AR, 2 per block
        assert (fwd[ALL_REDUCE], fwd[ALL_GATHER], fwd["total"]) == (5, 1, 6), fwd
        assert (bwd[ALL_REDUCE], bwd["total"]) == (5, 5), bwd


@pytest.mark.parametrize("tp_size", [2, 4])
@distributed(world_size=4)
def test_init_is_tp_invariant_and_padding_never_wins(tp_size):
    mesh = tp.init_mesh(tp=tp_size)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_heads=4, num_kv_heads=1, ffn_hidden_size=24,
                              position="learned", norm="layernorm", bias=True)
    torch.manual_seed(3)
    parallel = hf_state_dict(models.GPT(config.replace(hf_model_type="gpt2", activation="gelu_tanh")))
    solo = torch.distributed.new_group([torch.distributed.get_rank()], use_local_synchronization=True)
    torch.manual_seed(3)
    serial = hf_state_dict(models.GPT(config.replace(hf_model_type="gpt2", activation="gelu_tanh"), group=solo),
                           group=solo)
    assert set(parallel) == set(serial)
    for name in parallel:
        assert torch.equal(parallel[name], serial[name]), name
    torch.manual_seed(3)
    model = models.GPT(config)
    assert model.padded_vocab_size == 128 * tp_size
    with torch.no_grad():
        model.output.weight.fill_(1.0)  # real and padding columns give equal logits...
        logits = model(tokens(0)[0])
    assert logits.shape == (BATCH, SEQ, VOCAB)  # ...but the padding columns are dropped
    assert mesh.tp_size == tp_size


@distributed(world_size=2)
def test_init_draws_on_the_cpu_and_moves_to_the_default_device():
    """(A GPU's default device: meta here.) The same CPU draws as a CPU build, the CPU generator left where a CPU
    build leaves it, the parameters on the default device: a GPU run starts from a CPU run's weights."""
    tp.init_mesh(tp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_heads=4, num_kv_heads=2, ffn_hidden_size=24)
    torch.manual_seed(3)
    models.GPT(config)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    with torch.device("meta"):
        model = models.GPT(config)
    assert torch.equal(torch.get_rng_state(), after)
    assert {p.device.type for p in model.parameters()} == {"meta"}


@distributed(world_size=2)
def test_recomputed_norms_under_torch_ddp_give_each_gradient_once():
    """Selective recompute of the norms under torch DDP at dp 2 (both norms and biases): each parameter's gradient
    reaches DDP's reducer once (it was accumulated inside the recomputed graph's backward and again as the node's
    input: "marked ready twice"), and the averaged gradients are the run's without recompute."""
    mesh = tp.init_mesh(dp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_heads=4, ffn_hidden_size=24, num_layers=2,
                              norm="layernorm", bias=True)
    x, y = tokens(5 + mesh.dp_rank)

    def grads(recompute, **options):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(models.GPT(config.replace(recompute=recompute, **options)),
                                                          process_group=mesh.dp_group)
        model(x, y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads("none")
    recomputed = grads("selective", recompute_modules=("layernorm", "core_attn", "mlp"))
    assert recomputed.keys() == plain.keys()
    for name, grad in recomputed.items():  # (the norms' input gradient joins the residual's in another order)
        assert_close(grad, plain[name], 1e-6, name)


def test_a_recomputed_function_reading_an_undeclared_parameter_is_refused():
    """DiscardedOutput returns the gradients of its inputs and declared params; one that fn reads undeclared would
    get none: its backward names it instead."""
    from tp.recompute import DiscardedOutput

    norm, scale = torch.nn.LayerNorm(4), torch.nn.Parameter(torch.ones(4))
    x = torch.randn(3, 4, requires_grad=True)
    kept = DiscardedOutput(lambda t: norm(t) * scale, x, params=norm.parameters())
    with pytest.raises(RuntimeError, match=r"reads a tensor that needs a gradient but is not among its inputs or "
                                           r"params: a Parameter of shape \(4,\)"):
        kept.output.sum().backward()
    done = DiscardedOutput(lambda t: norm(t) * scale, x, params=[*norm.parameters(), scale])
    assert getattr(done.output, KEPT_BY_PRODUCER)  # (an fp8 linear reading it saves it, not a copy)
    done.output.sum().backward()
    assert scale.grad is not None and norm.weight.grad is not None


@distributed(world_size=2)
def test_dropout_masks_and_recompute_give_the_same_gradients():
    mesh = tp.init_mesh(tp=2)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_heads=4, ffn_hidden_size=24,
                              dropout=0.3, attention_dropout=0.3)
    x, y = tokens(1)

    def grads(recompute, sequence_parallel=False, **options):
        torch.manual_seed(0)
        model = models.GPT(config.replace(recompute=recompute, sequence_parallel=sequence_parallel, num_layers=3,
                                          **options)).train()
        tp.model_parallel_seed(11)
        model(x, y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads("none")
    for recompute, options in (("selective", {}), ("full", {}), ("selective", dict(recompute_modules=("mlp",))),
                               ("full", dict(recompute_num_layers=2)),
                               ("full", dict(recompute_method="block", recompute_num_layers=2))):
        for name, grad in grads(recompute, **options).items():
            assert torch.equal(grad, plain[name]), (recompute, options, name)
    # layernorm: the norms' input gradient joins the residual's in another order than autograd's (rounding apart)
    for name, grad in grads("selective", recompute_modules=("layernorm", "core_attn", "mlp")).items():
        assert_close(grad, plain[name], 1e-6, name)
    plain_sp = grads("none", sequence_parallel=True)  # (the norms' grads summed over tp inside the recomputed graph)
    for name, grad in grads("selective", sequence_parallel=True, recompute_modules=("layernorm",)).items():
        assert_close(grad, plain_sp[name], 1e-6, name)
    no_dropout = models.GPT(config.replace(dropout=0.0, attention_dropout=0.0))
    assert no_dropout.training  # dropout 0: nothing is drawn even in training mode
    # The masks are counter-based (without sample_ids, every tp rank draws the same start from the default generator
    # model_parallel_seed seeds alike): the replicated norms' grads agree.
    every = [torch.empty_like(plain["layers.0.norm1.weight"]) for _ in range(2)]
    torch.distributed.all_gather(every, plain["layers.0.norm1.weight"], group=mesh.tp_group)
    assert torch.equal(every[0], every[1])
    sp = grads("full", sequence_parallel=True)
    assert sp["layers.0.norm1.weight"].shape == plain["layers.0.norm1.weight"].shape


@distributed(world_size=4)
def test_bad_configs_raise_on_every_rank_before_any_collective():
    tp.init_mesh(tp=4)
    base = dict(vocab_size=VOCAB, hidden_size=24, num_heads=4, ffn_hidden_size=24)
    cases = [
        (dict(num_heads=6, head_dim=4), r"num_heads=6 is not divisible by tp=4"),
        (dict(num_heads=8, num_kv_heads=6, head_dim=3), r"num_heads=8 is not divisible by num_kv_heads=6"),
        (dict(num_heads=12, num_kv_heads=6, head_dim=2), r"num_kv_heads=6 is not divisible by tp=4"),
        (dict(num_heads=12, num_kv_heads=3, head_dim=2), r"tp=4 is not divisible by num_kv_heads=3"),
        (dict(ffn_hidden_size=30), r"ffn_hidden_size=30 is not divisible by tp=4"),
        (dict(hidden_size=26), r"hidden_size=26 is not divisible by num_heads=4: give head_dim"),  # (was 6, silently)
        (dict(head_dim=0), r"head_dim=0 must be"),  # (was hidden_size // num_heads, silently)
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            models.GPT(models.GPTConfig(**base | changes))
    with pytest.raises(ValueError, match=r"activation='relu' must be one of"):
        models.GPTConfig(**base, activation="relu")
    model = models.GPT(models.GPTConfig(**base, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"s divisible by tp = 4, got shape \(6, 2\)"):
        model(torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"):
        model(torch.full((2, 8), VOCAB))
    with pytest.raises(ValueError, match=r"sequence length 300 exceeds max_seq_len=256"):
        model(torch.zeros(2, 300, dtype=torch.long))
    windowed = models.GPT(models.GPTConfig(**base, sliding_window=8))  # (Mistral's: it read "exceeds max_seq_len=256 /
    # sliding_window=8", as if 12 > 256)
    with pytest.raises(ValueError, match=r"^sequence length 12 exceeds sliding_window=8 \(attention within a sliding "
                                         r"window is not implemented: sequences up to it run as full attention\)$"):
        windowed(torch.zeros(2, 12, dtype=torch.long))


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("gpt2", 4)])
@distributed(world_size=2)
def test_hugging_face_round_trip_is_bit_exact_and_reads_only_shards(family, kv_heads):
    import shutil
    import tempfile

    from safetensors.torch import load_file

    from models.hf import load as hf_load

    mesh = tp.init_mesh(tp=2)
    root = [tempfile.mkdtemp(prefix="tp-roundtrip-") if mesh.rank == 0 else None]
    torch.distributed.broadcast_object_list(root)  # one directory every rank sees
    source, target = os.path.join(root[0], "source"), os.path.join(root[0], "target")
    if mesh.rank == 0:
        hf_model(family, kv_heads).save_pretrained(source)
    torch.distributed.barrier()
    reads = []
    read = hf_load._SafetensorsReader.read
    hf_load._SafetensorsReader.read = lambda self, name, *a: reads.append((name, *a)) or read(self, name, *a)
    try:
        model = models.GPT.from_hf(source)
    finally:
        hf_load._SafetensorsReader.read = read
    sharded = [r for r in reads if "mlp" in r[0] and r[0].endswith("weight")]
    assert sharded and all(len(r) == 4 for r in sharded)  # slices, never whole sharded tensors
    model.save_hf(target)
    torch.distributed.barrier()
    original, written = load_file(os.path.join(source, "model.safetensors")), \
        load_file(os.path.join(target, "model.safetensors"))
    written_keys = set(written)
    assert written_keys == set(original) - {"lm_head.weight"} or written_keys == set(original), \
        set(original) ^ written_keys
    for name, tensor in written.items():
        assert torch.equal(tensor, original[name]), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    x, _ = tokens(0)
    assert torch.equal(reloaded(x).logits, hf_model(family, kv_heads)(x).logits)
    torch.distributed.barrier()
    if mesh.rank == 0:
        shutil.rmtree(root[0])


@distributed(world_size=2)
def test_sequence_parallel_grads_can_wait_for_one_coalesced_all_reduce():
    """sequence_parallel_grad_sync=False: no all-reduce per norm/bias in backward, one after it, same grads."""
    mesh = tp.init_mesh(tp=2)
    x = torch.randn(SEQ, BATCH, 16, generator=rng(0)).chunk(2)[mesh.tp_rank]
    grads, counts = {}, {}
    for sync in (True, False):
        config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_heads=4, ffn_hidden_size=24, bias=True,
                                  norm="layernorm", sequence_parallel=True, sequence_parallel_grad_sync=sync)
        torch.manual_seed(0)
        block = models.TransformerBlock(config)
        y = block(x.clone().requires_grad_())
        _, counts[sync] = comm_counts(lambda: y.sum().backward())
        if not sync:
            tagged = {n for n, p in block.named_parameters() if getattr(p, "sequence_parallel", False)}
            assert tagged == {"norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attention.proj.bias",
                              "mlp.fc2.bias"}
            _, after = comm_counts(lambda: tp.allreduce_sequence_parallel_grads(block))
            assert after[ALL_REDUCE] == after["total"] == 1
        grads[sync] = {n: p.grad for n, p in block.named_parameters()}
    assert counts[True][ALL_REDUCE] == 4 and counts[False][ALL_REDUCE] == 0, counts
    for name, grad in grads[True].items():
        assert torch.allclose(grad, grads[False][name], rtol=0, atol=1e-6), name


@distributed(world_size=4)
def test_deepcopy_of_a_parallel_gpt_shares_its_groups():
    """copy.deepcopy of a GPT under tp x cp with SP (an EMA or reference copy) copies the weights, shares the process
    groups, and computes the same loss."""
    import copy

    mesh = tp.init_mesh(tp=2, cp=2)
    torch.manual_seed(0)
    config = models.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                              ffn_hidden_size=24, max_seq_len=SEQ, sequence_parallel=True)
    model = models.GPT(config, group=mesh.tp_group, cp_group=mesh.cp_group)
    twin = copy.deepcopy(model)
    assert twin.group is model.group and twin.cp_group is model.cp_group
    assert twin.layers[0].attention.cp_group is mesh.cp_group and twin.final_norm.group is mesh.tp_group
    assert twin.output.weight is not model.output.weight and torch.equal(twin.output.weight, model.output.weight)
    x, y = tokens(0)
    assert torch.equal(twin(x, y), model(x, y))
