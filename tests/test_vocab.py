"""Vocab-parallel embedding and cross-entropy against nn.Embedding / F.cross_entropy at TP = 1, 2, 4.

Forward and every gradient are compared with the dense computation on each rank, plus the collective counts.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tp
from tp.cross_entropy import vocab_parallel_cross_entropy
from tp.embedding import VocabParallelEmbedding
from tp.testing import distributed

from .helpers import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, assert_close, comm_counts, noncontiguous, randn, rng

S, B = 8, 3  # sequence (divisible by every tp size, for SP) / batch: odd
V, H = 20, 5  # at tp=4: 5 rows per rank; hidden odd


def token_ids(*shape, seed, vocab=V):
    g = rng(seed)
    return torch.randint(0, vocab, shape, generator=g).to(torch.get_default_device())


def dense_embedding(seed, dtype=torch.float64, **kwargs):
    torch.manual_seed(seed)
    return nn.Embedding(V, H, dtype=dtype, device="cpu", **kwargs).to(torch.get_default_device())


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_embedding_matches_dense(tp_size, sequence_parallel):
    mesh = tp.init_mesh(tp=tp_size)
    p, r = tp_size, mesh.tp_rank
    for padding_idx in (None, 7):
        dense = dense_embedding(1, padding_idx=padding_idx)
        layer = VocabParallelEmbedding.from_embedding(dense, sequence_parallel=sequence_parallel)
        ids = token_ids(S, B, seed=10 + mesh.dp_rank)  # same ids on every tp rank, its own per dp replica
        ids[0, 0] = 7
        ids_before = ids.clone()
        y_dense = dense(ids)  # [s, b, h]
        g = randn(*y_dense.shape, seed=20 + mesh.dp_rank)
        y_dense.backward(g)
        y, fwd = comm_counts(lambda: layer(ids))
        shard = (lambda t: t.chunk(p, 0)[r]) if sequence_parallel else (lambda t: t)
        assert_close(y, shard(y_dense.detach()), 1e-12, "output")
        _, bwd = comm_counts(lambda: y.backward(shard(g)))
        assert_close(layer.weight.grad, dense.weight.grad.chunk(p, 0)[r], 1e-12, "weight grad")
        assert torch.equal(ids, ids_before)
        if padding_idx is not None and layer.vocab_start <= 7 < layer.vocab_end:
            assert torch.count_nonzero(layer.weight.grad[7 - layer.vocab_start]) == 0
        expected = ({}, {}) if p == 1 else ({REDUCE_SCATTER: 1}, {ALL_GATHER: 1}) if sequence_parallel \
            else ({ALL_REDUCE: 1}, {})
        for counted, ops in zip((fwd, bwd), expected):
            assert counted["total"] == sum(ops.values()) and all(counted[k] == n for k, n in ops.items()), (fwd, bwd)
    if not sequence_parallel:  # any [...] shape of ids, fp32
        dense = dense_embedding(2, dtype=torch.float32)
        layer = VocabParallelEmbedding.from_embedding(dense)
        for ids in (token_ids(7, seed=3), token_ids(2, 3, 5, seed=4)):
            assert_close(layer(ids), dense(ids), 1e-6, f"fp32 output for ids {tuple(ids.shape)}")


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_embedding_init_is_tp_invariant(tp_size):
    r = tp.init_mesh(tp=tp_size).tp_rank
    for dtype, padding_idx in ((torch.float32, None), (torch.bfloat16, 3)):
        torch.manual_seed(7)
        layer = VocabParallelEmbedding(V, H, dtype=dtype, padding_idx=padding_idx)
        torch.manual_seed(7)
        dense = nn.Embedding(V, H, dtype=dtype, padding_idx=padding_idx, device="cpu")  # masters are drawn on CPU
        assert torch.equal(layer.weight.cpu(), dense.weight.detach().chunk(tp_size, 0)[r]), dtype
    torch.manual_seed(0)
    custom = VocabParallelEmbedding(V, H, init_method=lambda w: nn.init.normal_(w, std=0.02))
    torch.manual_seed(0)
    assert torch.equal(custom.weight.cpu(), torch.empty(V, H).normal_(std=0.02).chunk(tp_size, 0)[r])


@distributed(world_size=2)
def test_embedding_options_repr_and_bad_input_raise_on_every_rank():
    tp.init_mesh(tp=2)
    dense = nn.Embedding(V, H, dtype=torch.float64, padding_idx=-1)
    layer = VocabParallelEmbedding.from_embedding(dense, sequence_parallel=True)
    r = tp.get_mesh().tp_rank
    assert layer.weight.dtype == torch.float64 and layer.weight.shape == (10, 5) and layer.padding_idx == 19
    assert f"tp=2, vocab=[{10 * r}, {10 * r + 10}) (local weight 10x5), sequence_parallel=True" in repr(layer)
    as_fp32 = VocabParallelEmbedding.from_embedding(dense, dtype=torch.float32)  # options override the embedding's
    assert torch.equal(as_fp32.weight, dense.weight.detach().float().chunk(2)[r])
    with pytest.raises(ValueError, match="num_embeddings = 21 is not divisible across 2 ranks"):
        VocabParallelEmbedding(21, H)
    with pytest.raises(ValueError, match="does not support nn.Embedding's max_norm=1.0"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(V, H, max_norm=1.0))
    with pytest.raises(ValueError, match=r"master weight shape \(20, 4\) != \(20, 5\)"):
        layer.load_master(torch.zeros(V, 4))
    layer = VocabParallelEmbedding(V, H)
    for bad in (V, -1):
        ids = torch.tensor([[1, bad], [2, 3]])
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 20\)"):
            layer(ids)
    with pytest.raises(ValueError, match="token ids must be int64 or int32, got torch.float32"):
        layer(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"needs \[s, b\] ids with s divisible by tp = 2, got shape \(3, 2\)"):
        VocabParallelEmbedding(V, H, sequence_parallel=True)(torch.zeros(3, 2, dtype=torch.long))


def dense_cross_entropy(logits, targets, vocab_size, **kwargs):
    """F.cross_entropy on the real vocabulary columns, reshaped to the [..., V] / [...] convention."""
    flat = logits[..., :vocab_size].reshape(-1, vocab_size)
    loss = F.cross_entropy(flat, targets.reshape(-1), **kwargs)
    return loss.view(targets.shape) if kwargs.get("reduction") == "none" else loss


def check_cross_entropy(mesh, *, dtype, atol, vocab_size=V, noncontig=False, all_ignored=False, **kwargs):
    p, r = mesh.tp_size, mesh.tp_rank
    logits_full = randn(S, B, V, seed=30 + mesh.dp_rank, dtype=torch.float64).mul_(3).to(dtype)
    targets = token_ids(S, B, seed=40 + mesh.dp_rank, vocab=vocab_size)
    ignore_index = kwargs.get("ignore_index", -100)
    targets[1, :] = targets[5, 2] = ignore_index
    if all_ignored:
        targets.fill_(ignore_index)
    logits_full.requires_grad_()
    ref_dtype = torch.promote_types(dtype, torch.float32)  # the reference on the same (rounded) values, fp32 math
    loss_ref = dense_cross_entropy(logits_full.to(ref_dtype), targets, vocab_size, **kwargs)
    g = randn(loss_ref.numel(), seed=50 + mesh.dp_rank, dtype=ref_dtype).view(loss_ref.shape)
    loss_ref.backward(g)
    logits = logits_full.detach().chunk(p, -1)[r].clone()
    logits = (noncontiguous(logits) if noncontig else logits).requires_grad_()
    before = logits.detach().clone()
    loss, fwd = comm_counts(lambda: vocab_parallel_cross_entropy(logits, targets, vocab_size=vocab_size, **kwargs))
    assert loss.dtype == ref_dtype
    if all_ignored:
        assert loss.isnan() and loss_ref.isnan()
    else:
        assert_close(loss, loss_ref.detach(), atol, f"loss {kwargs}")
    _, bwd = comm_counts(lambda: loss.backward(g))
    assert logits.grad.dtype == dtype
    assert_close(logits.grad, logits_full.grad.chunk(p, -1)[r], atol, f"logits grad {kwargs}")
    assert torch.equal(logits.detach(), before), "input modified"
    assert (fwd[ALL_GATHER], fwd["total"], bwd["total"]) == ((1, 1, 0) if p > 1 else (0, 0, 0)), (fwd, bwd)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@distributed(world_size=4)
def test_cross_entropy_matches_dense(tp_size):
    mesh = tp.init_mesh(tp=tp_size)
    for reduction in ("mean", "sum", "none"):
        for label_smoothing in (0.0, 0.1):
            check_cross_entropy(mesh, dtype=torch.float64, atol=1e-12, reduction=reduction,
                                label_smoothing=label_smoothing, noncontig=reduction == "sum")
    check_cross_entropy(mesh, dtype=torch.float32, atol=1e-5, label_smoothing=0.2, ignore_index=3)
    check_cross_entropy(mesh, dtype=torch.bfloat16, atol=3e-4, label_smoothing=0.1)  # one bf16 rounding of the grad
    # padded vocabulary: columns >= 14 are padding (at tp=4 the last rank holds only padding)
    check_cross_entropy(mesh, dtype=torch.float64, atol=1e-12, vocab_size=14, label_smoothing=0.1, noncontig=True)
    check_cross_entropy(mesh, dtype=torch.float64, atol=0, all_ignored=True, ignore_index=-7)  # nan, zero grads


@distributed(world_size=2)
def test_cross_entropy_saves_only_local_shards():
    """Never a full-vocab tensor: everything kept for backward is [..., V/tp], [...] or a scalar."""
    tp.init_mesh(tp=2)
    logits = torch.randn(S, B, V // 2, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(logits, token_ids(S, B, seed=1))
    assert saved and all(s in ((S, B, V // 2), (S, B), ()) for s in saved), saved  # (): the mean's count
    loss.backward()


@distributed(world_size=2)
def test_cross_entropy_bad_input_raises_on_every_rank():
    tp.init_mesh(tp=2)
    logits = torch.randn(S, B, V // 2)
    targets = token_ids(S, B, seed=2, vocab=14)  # valid for every vocab_size below
    for bad, vocab_size in ((V, None), (-1, None), (15, 14)):
        t = targets.clone()
        t[2, 1] = bad
        with pytest.raises(ValueError, match=rf"target id {bad} is outside the vocabulary \[0, {vocab_size or V}\)"):
            vocab_parallel_cross_entropy(logits, t, vocab_size=vocab_size)
    with pytest.raises(ValueError, match=r"targets shape \(8, 2\) != logits shape without the vocab dim \(8, 3\)"):
        vocab_parallel_cross_entropy(logits, targets[:, :2])
    with pytest.raises(ValueError, match="reduction='avg' must be one of"):
        vocab_parallel_cross_entropy(logits, targets, reduction="avg")
    with pytest.raises(ValueError, match=r"label_smoothing=1.5 must be in \[0, 1\]"):
        vocab_parallel_cross_entropy(logits, targets, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"vocab_size=21 must be in \[1, 20\]"):
        vocab_parallel_cross_entropy(logits, targets, vocab_size=21)
    with pytest.raises(ValueError, match="targets must be int64 or int32, got torch.float32"):
        vocab_parallel_cross_entropy(logits, targets.float())


@distributed(world_size=2)
def test_cross_entropy_with_a_rank_whose_logits_are_all_masked():
    """A banned block of the vocabulary (-inf logits) on one rank: F.cross_entropy's finite loss, no NaN."""
    tp.init_mesh(tp=2)
    logits = randn(3, 8, seed=4)
    logits[:, :4] = -torch.inf  # rank 0's whole shard
    logits[0, 4:] -= 200.0  # very negative real logits must not underflow against a masked rank's max
    targets = torch.tensor([5, 6, 7])
    expected = F.cross_entropy(logits, targets)
    local = logits.chunk(2, -1)[tp.get_mesh().tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets)
    assert torch.isfinite(loss) and abs(loss.item() - expected.item()) <= 1e-10, (loss.item(), expected.item())
    loss.backward()
    assert torch.isfinite(local.grad).all()


@distributed(world_size=2)
def test_megatrons_positional_label_smoothing_is_accepted():
    """Megatron's vocab_parallel_cross_entropy(logits, target, label_smoothing): the third argument positional."""
    tp.init_mesh(tp=2)
    logits, targets = randn(4, 3, 5, seed=1), torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(2))
    assert torch.equal(tp.vocab_parallel_cross_entropy(logits, targets, 0.1, reduction="none"),
                       tp.vocab_parallel_cross_entropy(logits, targets, label_smoothing=0.1, reduction="none"))
