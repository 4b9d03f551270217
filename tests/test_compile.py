"""torch.compile: the layers, mappings, vocab-parallel embedding and loss, attention (dense and cp all-gather) and the
GPT trace with zero graph breaks at tp 1 and 2, with and without sequence parallelism (compiled with fullgraph=True,
which raises at any break; the GPT's breaks also counted by torch._dynamo.explain), and the compiled forward +
backward equals eager (fp32, 1e-5); so does the MoE layer, at ep 1 and 2; so do ring and all-gather attention with
documents and attention dropout, and compiled MoE blocks under full recompute. Shapes are tiny and the default run
keeps tp 2 with SP through AOT autograd's graphs: compiling is the slow part on CPU (`-m slow` adds the other
splits, inductor and the command line, also with each feature that once crashed under --compile)."""
import copy
import warnings

import pytest
import torch
import torch._dynamo as dynamo

import tp
from models import GPT, GPTConfig
from tp.testing import distributed

from .helpers import assert_close, randn, rng
from .moe_reference import MARGIN, routing_margin

# (tp, sequence_parallel): tp 2 with SP by default (every collective kind), the others slow (-m slow)
SPLITS = [pytest.param(1, False, marks=pytest.mark.slow), pytest.param(2, False, marks=pytest.mark.slow), (2, True)]
TOL = 1e-5


def graph_breaks(fn, *args):
    """The reasons torch._dynamo.explain gives for each graph break of fn(*args) (none: [])."""
    dynamo.reset()
    explained = dynamo.explain(fn)(*args)
    reasons = [f"{b.reason}".split("\n")[0] + (f" at {b.user_stack[-1]}" if b.user_stack else "")
               for b in explained.break_reasons]
    assert explained.graph_break_count == len(reasons) or reasons, explained
    return reasons


def compiled_equals_eager(module, loss_fn, *inputs, backend="aot_eager"):
    """loss_fn(module, *inputs) and every parameter's grad: a deep copy of module compiled with fullgraph=True (no
    break allowed) against module itself, eager."""
    twin = copy.deepcopy(module)
    compiled = torch.compile(lambda *a: loss_fn(twin, *a), fullgraph=True, backend=backend)
    dynamo.reset()
    want, got = loss_fn(module, *inputs), compiled(*inputs)
    want.backward()
    got.backward()
    assert_close(got, want, TOL, "loss")
    for (name, p), q in zip(module.named_parameters(), twin.parameters()):
        assert_close(q.grad, p.grad, TOL, f"grad of {name}")


class _MLP(torch.nn.Module):
    def __init__(self, sp):
        super().__init__()
        self.fc1 = tp.ColumnParallelLinear(8, 12, activation="gelu", sequence_parallel=sp)
        self.fc2 = tp.RowParallelLinear(12, 8, sequence_parallel=sp)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def _mlp_loss(mlp, x):
    return (mlp(x) ** 2).sum()


def _mappings_loss(x):
    """Every conjugate mapping once: the forward/backward collectives of each."""
    y = tp.copy_to_tp_region(x)
    y = tp.gather_from_tp_region(tp.scatter_to_tp_region(y)) + tp.reduce_from_tp_region(y * 2)
    y = tp.gather_from_sp_region(tp.scatter_to_sp_region(y))
    y = tp.reduce_scatter_to_sp_region(y) + tp.scatter_to_sp_region(y)
    return (tp.gather_from_sp_region(y, tensor_parallel_output_grad=False) ** 2).sum()


@pytest.mark.parametrize("tp_size,sp", SPLITS)
@distributed(world_size=2, timeout=300)
def test_layers_and_mappings_compile_without_breaks(tp_size, sp):
    tp.init_mesh(tp=tp_size)
    mlp = _MLP(sp)
    x = randn(4, 2, 8, seed=1, dtype=torch.float32)  # [s, b, h], replicated
    x_in = x.chunk(tp_size)[tp.get_mesh().tp_rank] if sp else x
    compiled_equals_eager(mlp, _mlp_loss, x_in)
    x = x.clone().requires_grad_()
    eager = _mappings_loss(x)
    grad, = torch.autograd.grad(eager, x)
    y = x.detach().clone().requires_grad_()
    compiled = torch.compile(_mappings_loss, fullgraph=True, backend="aot_eager")(y)
    compiled.backward()
    assert_close(compiled, eager, TOL, "mappings")
    assert_close(y.grad, grad, TOL, "mappings' input grad")


class _VocabLoss(torch.nn.Module):
    def __init__(self, sp):
        super().__init__()
        self.embedding = tp.VocabParallelEmbedding(16, 8, sequence_parallel=sp)
        self.output = tp.ColumnParallelLinear(8, 16, bias=False, sequence_parallel=sp)

    def forward(self, ids, targets):
        return tp.vocab_parallel_cross_entropy(self.output(self.embedding(ids)), targets, label_smoothing=0.1,
                                               vocab_size=15)


def _vocab_loss(module, ids, targets):
    return module(ids, targets)


@pytest.mark.parametrize("tp_size,sp", SPLITS)
@distributed(world_size=2, timeout=300)
def test_vocab_embedding_and_loss_compile_without_breaks(tp_size, sp):
    """The range checks of the ids and targets are device asserts under compile: no host read."""
    tp.init_mesh(tp=tp_size)
    module = _VocabLoss(sp)
    g = rng(3)
    ids, targets = torch.randint(0, 15, (4, 2), generator=g), torch.randint(0, 15, (4, 2), generator=g)
    targets[0, 0] = -100  # ignored
    compiled_equals_eager(module, _vocab_loss, ids, targets)
    with pytest.raises(RuntimeError, match=r"token id \(an id\) is outside the vocabulary \[0, 16\)"):
        torch.compile(_vocab_loss, fullgraph=True, backend="aot_eager")(module, ids + 16, targets)


def _attention_loss(q, k, v):
    return (tp.context_parallel_attention(q, k, v, causal=True, mode="allgather") ** 2).sum()


@distributed(world_size=2, timeout=300)
def test_cp_allgather_attention_compiles_without_breaks():
    tp.init_mesh(cp=2)
    q, k, v = (randn(1, h, 4, 4, seed=i, dtype=torch.float32, requires_grad=True) for i, h in enumerate((4, 2, 2)))
    eager = _attention_loss(q, k, v)
    grads = torch.autograd.grad(eager, (q, k, v))
    twins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(_attention_loss, fullgraph=True, backend="aot_eager")(*twins)
    compiled.backward()
    assert_close(compiled, eager, TOL, "loss")
    for name, t, g in zip("qkv", twins, grads):
        assert_close(t.grad, g, TOL, f"d{name}")


def _documents_dropout_loss(q, k, v, mode, documents, samples):
    dropout = tp.dropout.CounterDropout(0.2, 3, 1, samples)
    out = tp.context_parallel_attention(q, k, v, causal=True, mode=mode, document_ids=documents, dropout=dropout)
    return (out ** 2).sum()


@pytest.mark.parametrize("mode", ["ring", "allgather"])
@distributed(world_size=2, timeout=300)
def test_cp_attention_with_documents_and_dropout_compiles(mode):
    """The ring (its point-to-point transfers, which Dynamo cannot trace, as custom ops) and all-gather attention
    (its blocks not cut to the documents under compile: the cut reads the documents on the host) with documents and
    attention dropout: no break, and the compiled forward + backward equals eager."""
    tp.init_mesh(cp=2)
    q, k, v = (randn(2, h, 4, 4, seed=i, dtype=torch.float32, requires_grad=True) for i, h in enumerate((4, 2, 2)))
    documents, samples = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 2]]), torch.arange(2)
    eager = _documents_dropout_loss(q, k, v, mode, documents, samples)
    grads = torch.autograd.grad(eager, (q, k, v))
    twins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(_documents_dropout_loss, fullgraph=True, backend="aot_eager")
    got = compiled(*twins, mode, documents, samples)
    got.backward()
    assert_close(got, eager, TOL, "loss")
    for name, t, g in zip("qkv", twins, grads):
        assert_close(t.grad, g, TOL, f"d{name}")


def tiny_config(**overrides):
    return GPTConfig(**dict(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=32, max_seq_len=16) | overrides)


def _gpt_loss(model, tokens, targets):
    return model(tokens, targets)


@pytest.mark.parametrize("tp_size,sp,backend", [
    (1, False, None), (2, False, None), (2, True, None),
    *(pytest.param(*split, "aot_eager", marks=pytest.mark.slow) for split in ((1, False), (2, False), (2, True))),
    pytest.param(2, True, "inductor", marks=pytest.mark.slow)])
@distributed(world_size=2, timeout=600)
def test_gpt_compiles_without_breaks(tp_size, sp, backend):
    """The whole GPT: no break (explain counts them), and (with a backend: slow; test_compile_blocks_equals_eager and
    the layers' tests check compiled = eager by default) its compiled step equals eager."""
    tp.init_mesh(tp=tp_size)
    model = GPT(tiny_config(sequence_parallel=sp))
    g = rng(5)
    tokens, targets = (torch.randint(0, 50, (2, 8), generator=g) for _ in range(2))
    assert graph_breaks(_gpt_loss, model, tokens, targets) == []
    if backend is not None:
        compiled_equals_eager(model, _gpt_loss, tokens, targets, backend=backend)


def _moe_loss(moe, x):
    return (moe(x) ** 2).sum()


MOE_SPLITS = [  # tp, sp, ep, etp, dispatcher, capacity factor, shared expert
    pytest.param(1, False, 2, None, "alltoall", None, True, id="tp1-ep2-alltoall-shared"),
    pytest.param(2, True, 1, None, "allgather", 1.0, False, id="tp2sp-ep1-etp2-allgather-capacity"),
    pytest.param(2, True, 2, 1, "alltoall", 0.5, True, id="tp2sp-ep2-etp1-alltoall-capacity"),
    pytest.param(1, False, 2, None, "allgather", None, False, id="tp1-ep2-allgather", marks=pytest.mark.slow),
    pytest.param(2, False, 2, 1, "alltoall", None, False, id="tp2-ep2-etp1-replicated", marks=pytest.mark.slow),
    pytest.param(1, False, 1, None, "alltoall", 1.0, False, id="tp1-ep1-capacity", marks=pytest.mark.slow),
    pytest.param(2, True, 1, None, "alltoall", None, True, id="tp2sp-ep1-etp2-alltoall", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tp_size,sp,ep,etp,dispatcher,capacity_factor,shared", MOE_SPLITS)
@distributed(world_size=2, timeout=300)
def test_moe_layer_compiles_without_breaks(tp_size, sp, ep, etp, dispatcher, capacity_factor, shared):
    """The MoE layer: no break (the dispatch's host-sized collectives and grouped GEMMs are custom ops whose outputs
    have data-dependent sizes), and the compiled forward + backward equals eager, every gradient, at ep 1 and 2, tp 1
    and 2 (with and without SP), both dispatchers, dropless and with a capacity factor. The default run keeps every
    dispatch path once: the all-to-all with its count exchange, the etp gather, the all-gather's slot selection,
    dropless and dropping. (fp32 routing on both sides, yet alike on any machine: aot_eager runs the eager ATen
    kernels on the same inputs, bit for bit here, and no top-k choice of this rank's tokens is near a tie, so the
    drop count, a count of choices over the capacity, is alike too.)"""
    mesh = tp.init_mesh(tp=tp_size, ep=ep, etp=etp)
    moe = tp.moe.MoE(8, 12, 4, 2, dispatcher=dispatcher, capacity_factor=capacity_factor, sequence_parallel=sp,
                     shared_expert_size=6 if shared else 0, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
                     data_parallel_size=1, init_std=0.5)  # (gradients of order 1: the tolerance is absolute)
    x = randn(4, 2, 8, seed=mesh.rank if sp or tp_size == 1 else 0, dtype=torch.float32)  # [s(/tp), b, h]
    assert routing_margin(moe.router(x.reshape(-1, 8)).logits, 2) >= MARGIN  # (tests/moe_reference.py)
    with tp.moe.dynamic_shapes():
        assert graph_breaks(_moe_loss, moe, x) == []
        compiled_equals_eager(moe, _moe_loss, x)
    if capacity_factor is not None:  # the policy dropped slots (on some rank)
        dropped = moe.dropped_slots.clone()
        torch.distributed.all_reduce(dropped)
        assert dropped > 0


@pytest.mark.parametrize("moe", [True, pytest.param(False, marks=pytest.mark.slow)])
@distributed(world_size=2, timeout=300)
def test_compile_blocks_equals_eager(moe):
    """GPT.compile_blocks (models.train --compile): each block compiled in place, fullgraph (MoE blocks too), the
    parameters' names kept; the step equals eager (tp 2 with SP; a dense and an MoE layer, slow: one dense layer)."""
    tp.init_mesh(tp=2)
    experts = dict(num_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=8) if moe else dict(num_layers=1)
    config = tiny_config(sequence_parallel=True, **experts)
    model, twin = (GPT(config) for _ in range(2))
    twin.load_state_dict(model.state_dict())
    twin.compile_blocks(backend="aot_eager")
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    tokens, targets = (torch.randint(0, 50, (2, 8), generator=rng(7)) for _ in range(2))
    torch._dynamo.utils.warn_once_cache.clear()  # (Dynamo warns once per process: this worker may have before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want, got = model(tokens, targets), twin(tokens, targets)
    # a user's --compile run prints none of Dynamo's warnings about our code (the RoPE tables' lru_cache was one)
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message)[:200] for w in caught]
    want.backward()
    got.backward()
    assert_close(got, want, TOL, "loss")
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(q.grad, p.grad, TOL, f"grad of {name}")


@distributed(world_size=2, timeout=600)
def test_compiled_moe_blocks_under_full_recompute_equal_eager():
    """--compile --recompute full on an MoE model with aux and z losses and the sigmoid router: the forward's
    bookkeeping under activation checkpointing (the last aux losses, the router's loads) is done once, so over two
    steps (the selection bias updated between them) the losses, gradients, loads and biases equal eager's."""
    tp.init_mesh(tp=2)
    config = tiny_config(sequence_parallel=True, num_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=8,
                         moe_router_score="sigmoid", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                         recompute="full")
    model, twin = (GPT(config) for _ in range(2))
    twin.load_state_dict(model.state_dict())
    twin.compile_blocks(backend="aot_eager")
    routers = [[m for m in gpt.modules() if isinstance(m, tp.moe.TopKRouter)] for gpt in (model, twin)]
    for step in range(2):
        tokens, targets = (torch.randint(0, 50, (4, 8), generator=rng(7 + step)) for _ in range(2))
        want, got = model(tokens, targets), twin(tokens, targets)
        want.backward()
        got.backward()
        assert_close(got, want, TOL, "loss")
        for ours, theirs in zip(tp.moe.aux_losses(twin), tp.moe.aux_losses(model)):
            assert_close(ours.load_balancing, theirs.load_balancing, TOL, "aux loss")
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert_close(q.grad, p.grad, TOL, f"grad of {name}")
        for theirs, ours in zip(*routers):
            assert torch.equal(ours.expert_load, theirs.expert_load), (step, ours.expert_load, theirs.expert_load)
        for gpt in (model, twin):
            tp.moe.update_expert_bias(gpt, 1e-3)
        for theirs, ours in zip(*routers):
            assert torch.equal(ours.expert_bias, theirs.expert_bias) and (step or theirs.expert_bias.any())


def _eager_and_compiled_losses(tmp_path, flags, steps):
    """The losses `python -m models.train *flags` logs eagerly and with --compile (inductor, per block)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")} | {"OMP_NUM_THREADS": "1"}
    losses = []
    for extra in ([], ["--compile"]):
        log = tmp_path / f"log{len(extra)}.jsonl"
        result = subprocess.run([sys.executable, "-m", "models.train", "--steps", str(steps), "--no-sample", *flags,
                                 "--log-jsonl", str(log), "--log-dir", str(tmp_path / f"logs{len(extra)}"), *extra],
                                capture_output=True, text=True, timeout=900, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append([json.loads(line)["loss"] for line in log.read_text().splitlines() if '"loss"' in line])
    assert len(losses[0]) == steps
    return losses


def test_compile_with_a_split_backward_schedule_is_refused_before_any_process(capsys):
    """--compile --schedule zb: the zero-bubble schedule defers each layer's weight gradient to a W pass, which a
    compiled block's backward cannot split: one line naming both flags, exit 2, no process started."""
    from models.training.cli import main

    assert main(["--tp", "1", "--pp", "2", "--dp", "1", "--schedule", "zb", "--compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile --schedule zb" in err[0] and "1f1b" in err[0], err


@pytest.mark.slow
def test_models_train_compile_gives_the_eager_losses(tmp_path):
    """`python -m models.train --compile` (inductor, per block) logs the losses of the eager run (tp 2)."""
    eager, compiled = _eager_and_compiled_losses(tmp_path, ["--tp", "2", "--pp", "1", "--dp", "1", "--seq-len", "32",
                                                            "--global-batch-size", "4"], 3)
    assert compiled == pytest.approx(eager, abs=1e-5)


DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids"]
FEATURES = {  # each crashed at its first compiled step before issue 35
    "ring": ["--cp", "2"],
    "documents, attention dropout": [*DOCUMENTS, "--attention-dropout", "0.1"],
    "documents, allgather": ["--cp", "2", "--cp-mode", "allgather", *DOCUMENTS],
    "moe, full recompute, aux and z losses, sigmoid router": ["--model", "tiny-moe", "--recompute", "full",
                                                              "--moe-router-score", "sigmoid",
                                                              "--moe-z-loss-coeff", "0.01"],
}


@pytest.mark.slow
@pytest.mark.parametrize("feature", list(FEATURES))
def test_models_train_compile_with_each_feature_gives_the_eager_losses(feature, tmp_path):
    """--compile with the ring, documents (with attention dropout, with all-gather cp) and an MoE model under full
    recompute (aux and z losses, the sigmoid router's loads): two steps, the eager run's losses."""
    from .test_documents import token_file

    data = ["--data", str(token_file(tmp_path))] if "--reset-attention-mask" in FEATURES[feature] else []
    eager, compiled = _eager_and_compiled_losses(tmp_path, ["--tp", "1", "--pp", "1", "--dp", "1", "--seq-len", "32",
                                                            "--global-batch-size", "2", "--micro-batch-size", "1",
                                                            *FEATURES[feature], *data], 2)
    assert compiled == pytest.approx(eager, abs=1e-5)
