"""Context parallelism: cp_shard / cp_unshard / cp_positions and context_parallel_attention against dense SDPA on the
full tensors (fp64 ~1e-12, fp32 ~1e-5, bf16 vs fp64), the p2p and collective traffic, memory, and causal balance."""
import contextlib
import functools
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tp
from tp.context import blocks
from tp.testing import distributed

from .helpers import assert_close, comm_counts, randn, rng

C, D = 3, 6  # tokens per chunk (s = 2·cp·C) and head dim: odd-ish sizes
HEADS = [(4, 4), (4, 2), (3, 1)]  # MHA, GQA, MQA
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
KV_MODES = ("ring", "allgather")  # the modes that split the sequence, not the heads


def own_slots(x, dim, rank, cp):
    """This rank's chunks of x, from the layout's definition (chunk t belongs to ranks t and 2cp−1−t)."""
    c = x.shape[dim] // (2 * cp)
    idx = [t for t in range(x.shape[dim]) if t // c in (rank, 2 * cp - 1 - rank)]
    return x.index_select(dim, torch.tensor(idx))


def qkv_full(b, heads, kv_heads, s, dtype, seed):
    q = randn(b, heads, s, D, seed=seed, dtype=dtype)
    k, v = (randn(b, kv_heads, s, D, seed=seed + i, dtype=dtype) for i in (1, 2))
    return q, k, v, randn(b, heads, s, D, seed=seed + 3, dtype=dtype)


def dense(q, k, v, dout, causal):
    """Output and q/k/v grads of SDPA on the full tensors (fp64)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def check_against_dense(mesh, mode, causal, heads, kv_heads, b, dtype, atol, seed=0):
    cp, r = mesh.cp_size, mesh.cp_rank
    full = qkv_full(b, heads, kv_heads, 2 * cp * C, dtype, seed)
    expected = [own_slots(t, 2, r, cp) for t in dense(*full, causal)]
    # [b, s, heads, d] storage seen as [b, heads, s, d]: the layout a model's projections give (not contiguous)
    q, k, v, dout = (own_slots(t, 2, r, cp).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(i < 3)
                     for i, t in enumerate(full))
    out = tp.context_parallel_attention(q, k, v, causal=causal, mode=mode)
    out.backward(dout)
    what = f"{mode} causal={causal} heads={heads}/{kv_heads} b={b} {dtype}"
    assert out.dtype == dtype and q.grad.dtype == dtype
    for got, want, name in zip((out, q.grad, k.grad, v.grad), expected, ("out", "dq", "dk", "dv")):
        assert_close(got, want, atol, f"{what} {name}")


class P2PCounter:
    """Records every dist.batch_isend_irecv call: per call, the (op name, bytes, group peer) of each P2POp."""

    def __init__(self):
        self.calls = []

    def __call__(self, ops):
        self.calls.append([(op.op.__name__, op.tensor.numel() * op.tensor.element_size(),
                            dist.get_group_rank(op.group, op.peer)) for op in ops])
        return self.batch_isend_irecv(ops)

    def __enter__(self):
        self.batch_isend_irecv = dist.batch_isend_irecv
        self._patch = mock.patch.object(dist, "batch_isend_irecv", self)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)


@pytest.mark.parametrize("cp", [1, 2, 4])
@distributed(world_size=4)
def test_attention_equals_dense_sdpa(cp):
    mesh = tp.init_mesh(cp=cp)  # cp=2: two cp groups (dp=2) at once
    for mode in KV_MODES:
        for causal in (True, False):
            for i, (heads, kv_heads) in enumerate(HEADS):
                b = 1 + i % 2
                check_against_dense(mesh, mode, causal, heads, kv_heads, b, torch.float64, 1e-12)
                check_against_dense(mesh, mode, causal, heads, kv_heads, 3 - b, torch.float32, 1e-5, seed=7)
    if cp == 1:  # a group of one rank is SDPA itself: same numbers, no communication
        q, k, v, _ = qkv_full(2, 4, 2, 8, torch.float32, seed=3)
        with P2PCounter() as p2p:
            out, counts = comm_counts(lambda: tp.context_parallel_attention(q, k, v, mode="allgather"))
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        assert counts["total"] == 0 and p2p.calls == []


@distributed(world_size=4)
def test_full_tokens_on_every_rank_compose_with_shard_and_unshard():
    """The model's use: replicated full q/k/v -> cp_shard -> attention -> cp_unshard -> a replicated loss; the per-rank
    gradients of the full inputs sum over cp to the dense ones."""
    mesh = tp.init_mesh(cp=4)
    for mode in KV_MODES:
        full = qkv_full(2, 4, 2, 8 * C, torch.float64, seed=11)
        expected = dense(*full, causal=True)
        q, k, v = (t.clone().requires_grad_() for t in full[:3])
        out = tp.cp_unshard(tp.context_parallel_attention(*(tp.cp_shard(t, 2) for t in (q, k, v)), mode=mode), 2)
        assert_close(out, expected[0], 1e-12, f"{mode} out")
        out.backward(full[3])
        for t, want, name in zip((q, k, v), expected[1:], "qkv"):
            mine = lambda x: own_slots(x, 2, mesh.cp_rank, 4)  # noqa: E731
            assert_close(mine(t.grad), mine(want), 1e-12, f"{mode} d{name} own slots")
            assert t.grad.count_nonzero() == mine(t.grad).count_nonzero()  # zeros elsewhere
            dist.all_reduce(t.grad, group=mesh.cp_group)
            assert_close(t.grad, want, 1e-12, f"{mode} d{name} summed over cp")


@pytest.mark.parametrize("cp", [2, 4])
@distributed(world_size=4)
def test_communication_and_bf16(cp):
    """ring: cp−1 sends of this rank's packed K,V forward; backward cp−1 again plus cp of dK/dV in fp32 (the last
    one home), no collective. allgather: 1 all-gather forward, 1 reduce-scatter backward, no p2p. bf16 in and out."""
    mesh = tp.init_mesh(cp=cp)
    b, heads, kv_heads, n = 2, 4, 2, 2 * C
    kv_bytes = 2 * b * kv_heads * n * D  # elements of one [2, b, kv_heads, n, d] message
    nxt, prev = (mesh.cp_rank + 1) % cp, (mesh.cp_rank - 1) % cp
    full = qkv_full(b, heads, kv_heads, cp * n, torch.bfloat16, seed=5)
    expected = [own_slots(t, 2, mesh.cp_rank, cp) for t in dense(*full, causal=True)]
    for mode in KV_MODES:
        q, k, v, dout = (own_slots(t, 2, mesh.cp_rank, cp).requires_grad_(i < 3) for i, t in enumerate(full))
        with P2PCounter() as p2p, blocks_logged_in(p2p.calls):  # the p2p calls and the blocks, in order
            out, fwd = comm_counts(lambda: tp.context_parallel_attention(q, k, v, mode=mode))
            fwd_p2p = p2p.calls[:]
            _, bwd = comm_counts(lambda: out.backward(dout))
            bwd_p2p = p2p.calls[len(fwd_p2p):]
        if mode == "ring":
            kv_call = [("isend", 2 * kv_bytes, nxt), ("irecv", 2 * kv_bytes, prev)]  # bf16 on the wire
            dkv_call = [("isend", 4 * kv_bytes, nxt), ("irecv", 4 * kv_bytes, prev)]  # fp32 accumulators
            # the next KV is on its way before this step's blocks (2 at step 0, then 1) are computed; dK/dV move on
            # once they are added, the last time home
            blocks = [["block"] * (2 if step == 0 else 1) for step in range(cp)]
            assert fwd_p2p == [x for step in range(cp) for x in [kv_call][:cp - 1 - step] + blocks[step]]
            assert bwd_p2p == [x for step in range(cp) for x in [kv_call][:cp - 1 - step] + blocks[step] + [dkv_call]]
            assert fwd["total"] == bwd["total"] == 0
        else:
            assert fwd_p2p == ["block"] * 2 and bwd_p2p == ["block"] * 2  # one per local chunk, no p2p
            assert (fwd["all_gather"], fwd["total"], bwd["reduce_scatter"], bwd["total"]) == (1, 1, 1, 1)
        for got, want, name in zip((out, q.grad, k.grad, v.grad), expected, ("out", "dq", "dk", "dv")):
            assert got.dtype == torch.bfloat16
            assert_close(got, want, 2e-2, f"{mode} bf16 {name}")


@distributed(world_size=2)
def test_bf16_blocks_are_fp32_under_autocast():
    """Under torch.autocast (bf16 q/k/v from autocast linears) the blocks still run in fp32: the same output and
    grads as without autocast, forward and backward (autocast would round the scores to bf16 before the softmax)."""
    mesh = tp.init_mesh(cp=2)
    full = [3 * t for t in qkv_full(1, 4, 2, 4 * 8, torch.float32, seed=9)]  # large logits, as in trained models
    local = [own_slots(t, 2, mesh.cp_rank, 2).bfloat16() for t in full]
    for mode in KV_MODES:
        results = []
        for autocast in (False, True):
            q, k, v = (t.clone().requires_grad_() for t in local[:3])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = tp.context_parallel_attention(q, k, v, mode=mode)
                out.backward(local[3])
            results.append((out, q.grad, k.grad, v.grad))
        for plain, autocast, name in zip(*results, ("out", "dq", "dk", "dv")):
            assert torch.equal(plain, autocast), f"{mode} {name}: {(plain - autocast).abs().max().item():.3g}"


@contextlib.contextmanager
def blocks_logged_in(log):
    """Append "block" to `log` at every block attention, forward or backward."""
    def logging(fn):
        return lambda *args: log.append("block") or fn(*args)

    with mock.patch.object(blocks, "block_forward", logging(blocks.block_forward)), \
            mock.patch.object(blocks, "block_backward", logging(blocks.block_backward)):
        yield


class ShapeRecorder(TorchDispatchMode):
    """The shape of every tensor an op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@distributed(world_size=4)
def test_ring_never_holds_the_full_sequence():
    tp.init_mesh(cp=4)
    b, heads, kv_heads, n = 2, 4, 2, 2 * C
    s = 4 * n  # 24: larger than every other size here
    recorded = {}
    for mode in KV_MODES:
        local = qkv_full(b, heads, kv_heads, n, torch.float32, seed=1)
        q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(local))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t), \
                ShapeRecorder() as ops:
            tp.context_parallel_attention(q, k, v, mode=mode).backward(dout)
        recorded[mode] = saved, ops.shapes
    saved, shapes = recorded["ring"]
    assert saved and all(max(shape, default=0) < s for shape in saved), saved
    assert all(max(shape, default=0) < s for shape in shapes), [x for x in shapes if max(x, default=0) >= s]
    assert max(math.prod(shape) for shape in shapes) <= b * heads * n * n  # the largest: one block's scores
    # the same recorders do see the sequence in all-gather mode: the gathered KV is saved, [c, <= s] scores
    saved, shapes = recorded["allgather"]
    assert (2, b, kv_heads, s, D) in saved and max(max(x, default=0) for x in shapes) == s


@pytest.mark.parametrize("causal", [True, False])
@distributed(world_size=4)
def test_every_rank_does_the_same_work(causal):
    """Query x key products of every block each rank computes (forward and backward), gathered over the group."""
    mesh = tp.init_mesh(cp=4)
    b, heads, kv_heads, n = 1, 4, 2, 2 * C
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(qkv_full(b, heads, kv_heads, n, torch.float64, 2)))
    for mode in KV_MODES:
        products = {"forward": 0, "backward": 0}

        def counting(name, fn):
            def count(q, k, *args):
                products[name] += q.shape[:-1].numel() * k.shape[-2]  # b·heads·m·n
                return fn(q, k, *args)
            return count

        with mock.patch.object(blocks, "block_forward", counting("forward", blocks.block_forward)), \
                mock.patch.object(blocks, "block_backward", counting("backward", blocks.block_backward)):
            tp.context_parallel_attention(q, k, v, causal=causal, mode=mode).backward(dout)
        per_rank = [None] * 4
        dist.all_gather_object(per_rank, products, group=mesh.cp_group)
        assert all(p == products for p in per_rank), (mode, per_rank)
        # causal: (2cp + 1)·c² on every rank. ring: c² + 2c² at step 0, then c·n = 2c² per step;
        # allgather: chunk r vs (r+1)·c keys, chunk 2cp−1−r vs (2cp−r)·c
        expected = C * C * (2 * 4 + 1) if causal else 4 * n * n
        assert products == {"forward": b * heads * expected, "backward": b * heads * expected}, (mode, products)


def test_a_fully_masked_block_gives_no_nan():
    g = rng(0)
    q, k, v, dout = (torch.randn(1, 1, 2, *shape, generator=g, dtype=torch.float64)
                     for shape in ((3, 4), (2, 4), (2, 4), (3, 4)))
    k, v = k[:, :, 0], v[:, :, 0]  # [b, kv_heads, n, d]
    # 3 queries aligned to the last 2 keys: query 0 sees none of them
    mask = torch.ones(3, 2, dtype=torch.bool).triu()  # key j hidden from query i when j > i − 1
    out, lse = blocks.block_forward(q, k, v, 0.5, mask)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[..., 0, :] == 0).all() and (lse[..., 0] == -math.inf).all() and lse[..., 1:].isfinite().all()
    acc_out, acc_lse = torch.zeros_like(out), torch.full_like(lse, -math.inf)
    blocks.merge(acc_out, acc_lse, out, lse)  # a fully masked row merged into an empty one stays empty
    assert torch.equal(acc_out, out) and torch.equal(acc_lse, lse)
    delta = (dout * out).sum(-1)
    grads = blocks.block_backward(q, k, v, dout, lse, delta, 0.5, mask)
    assert all(not g.isnan().any() for g in grads) and (grads[0][..., 0, :] == 0).all()


@distributed(world_size=4)
def test_shard_unshard_and_positions():
    for cp in (2, 4):
        mesh = tp.init_mesh(cp=cp)
        r, s = mesh.cp_rank, 4 * cp
        assert tp.cp_positions(s).tolist() == [t for t in range(s) if t // 2 in (r, 2 * cp - 1 - r)]
        assert tp.cp_positions(s).dtype == torch.int64
        for dim in (0, 1, -1):
            x = randn(s, s, seed=1).requires_grad_()
            shard, counts = comm_counts(lambda: tp.cp_shard(x, dim))
            assert counts["total"] == 0 and torch.equal(shard, own_slots(x.detach(), dim % 2, r, cp))
            if dim == 0:
                assert torch.equal(shard, x.detach()[tp.cp_positions(s)])
            y, counts = comm_counts(lambda: tp.cp_unshard(shard, dim))
            assert counts["all_gather"] == counts["total"] == 1 and torch.equal(y, x.detach())
            g = randn(s, s, seed=2)
            _, counts = comm_counts(lambda: y.backward(g))
            assert counts["total"] == 0  # unshard: keep own slots; shard: into own slots, zeros elsewhere
            assert torch.equal(own_slots(x.grad, dim % 2, r, cp), own_slots(g, dim % 2, r, cp))
            assert x.grad.count_nonzero() == own_slots(g, dim % 2, r, cp).count_nonzero()
            dist.all_reduce(x.grad, group=mesh.cp_group)
            assert torch.equal(x.grad, g)
        tp.destroy_mesh(keep_groups=True)
    tp.init_mesh(cp=1)
    x = randn(6, 5, seed=0)
    assert tp.cp_shard(x, 0) is x and tp.cp_unshard(x, 0) is x and tp.cp_positions(5).tolist() == list(range(5))


def test_without_a_mesh_one_process_is_cp_1():
    """docs/sequence-context-parallel.md: on one rank the attention is SDPA itself; with no mesh at all (no
    init_mesh, no process group) the cp functions run as cp = 1 rather than ask for a tensor-parallel mesh."""
    with pytest.raises(RuntimeError, match="no tensor-parallel mesh"):
        tp.get_mesh()
    q, k, v = (torch.randn(1, 2, 8, 4, generator=rng(i)) for i in range(3))
    out = tp.context_parallel_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert tp.cp_shard(q, 2) is q and tp.cp_unshard(q, 2) is q and tp.cp_positions(8).tolist() == list(range(8))


@distributed(world_size=2)
def test_bad_inputs_are_refused_before_any_communication():
    tp.init_mesh(cp=2)

    def qkv(heads=4, kv_heads=2, b=(2, 2), n=(4, 4), d=(6, 6)):
        return (torch.zeros(b[0], heads, n[0], d[0]), torch.zeros(b[1], kv_heads, n[1], d[1]),
                torch.zeros(b[1], kv_heads, n[1], d[1]))

    attention = tp.context_parallel_attention
    cases = [
        (lambda: attention(*qkv(heads=3)), r"heads=3 is not a multiple of kv_heads=2"),
        (lambda: attention(*qkv(b=(2, 3))), r"q's batch 2 != k/v's 3"),
        (lambda: attention(*qkv(n=(4, 6))), r"q's local sequence length 4 != k/v's 6"),
        (lambda: attention(*qkv(d=(6, 5))), r"q's head dim 6 != k/v's 5"),
        (lambda: attention(*qkv()[:2], torch.zeros(2, 2, 4, 5)), r"k \(2, 2, 4, 6\) and v \(2, 2, 4, 5\) differ"),
        (lambda: attention(*qkv(), mode="ulysses"), r"unknown mode 'ulysses'"),
        (lambda: attention(*qkv(n=(5, 5))), r"local sequence length 5 is odd.* cp group of 2"),
        (lambda: attention(torch.zeros(4, 5, 6), *qkv()[1:]), r"must be \[b, heads, s/cp, d\].*\(4, 5, 6\)"),
        (lambda: tp.cp_shard(torch.zeros(3, 6), 1), r"cp_shard: dim 1 of size 6 is not divisible by 2·cp = 4"),
        (lambda: tp.cp_positions(10), r"seq_len of size 10 is not divisible by 2·cp = 4"),
        (lambda: tp.cp_unshard(torch.zeros(3, 5), -1), r"cp_unshard: dim -1 of size 5 is odd"),
        (lambda: tp.cp_shard(torch.zeros(3, 8), 5), r"^cp_shard: dim 5 is out of range for a tensor of shape "
                                                     r"\(3, 8\)$"),
        (lambda: tp.cp_unshard(torch.zeros(3, 8), -3), r"^cp_unshard: dim -3 is out of range for a tensor of shape "),
    ]
    with CommDebugMode() as collectives, P2PCounter() as p2p:
        for fn, message in cases:
            with pytest.raises(ValueError, match=message):
                fn()
    assert collectives.get_total_counts() == 0 and p2p.calls == []


# ---- documents, Ulysses (a2a) and a2a+ring -------------------------------------------------------------------------

A2A_HEADS = [(4, 4), (4, 2), (4, 1), (8, 2)]  # MHA, GQA, MQA (kv heads replicated when fewer than the a2a group)


def documents(s, cp, seed):
    """[2, s] document ids covering the edge cases: row 0 a window that starts mid-document (its first id is 7),
    one-token documents and random lengths; row 1 one document longer than the window, but for boundaries inside
    chunk 0 only (so every other rank's share holds no document start)."""
    g = rng(seed)
    starts = (torch.rand(s, generator=g) < 0.3).long()
    starts[1:3] = 1  # a one-token document at position 1
    c = s // (2 * cp)
    row1 = torch.zeros(s, dtype=torch.long)
    row1[c // 2 + 1:] = 1
    return torch.stack([7 + starts.cumsum(0), row1])


def dense_by_document(q, k, v, dout, docs, causal=True):
    """Output and q/k/v grads of SDPA run on each document on its own (fp64): the packed window's reference."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rows = []
    for i in range(q.shape[0]):
        bounds = [0] + [t for t in range(1, docs.shape[1]) if docs[i, t] != docs[i, t - 1]] + [docs.shape[1]]
        rows.append(torch.cat([F.scaled_dot_product_attention(
            q[i:i + 1, :, a:b], k[i:i + 1, :, a:b], v[i:i + 1, :, a:b], is_causal=causal,
            enable_gqa=q.shape[1] != k.shape[1]) for a, b in zip(bounds, bounds[1:])], 2))
    out = torch.cat(rows)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def check_mode(mesh, mode, heads, kv_heads, dtype, atol, docs=None, a2a_size=None, causal=True, seed=0):
    cp, r = mesh.cp_size, mesh.cp_rank
    full = qkv_full(2, heads, kv_heads, 2 * cp * C, dtype, seed)
    reference = dense(*full, causal) if docs is None else dense_by_document(*full, docs, causal)
    expected = [own_slots(t, 2, r, cp) for t in reference]
    q, k, v, dout = (own_slots(t, 2, r, cp).requires_grad_(i < 3) for i, t in enumerate(full))
    out = tp.context_parallel_attention(q, k, v, causal=causal, mode=mode, document_ids=docs, a2a_size=a2a_size)
    out.backward(dout)
    what = f"{mode} a2a_size={a2a_size} heads={heads}/{kv_heads} docs={docs is not None} {dtype}"
    for got, want, name in zip((out, q.grad, k.grad, v.grad), expected, ("out", "dq", "dk", "dv")):
        assert got.dtype == dtype, what
        assert_close(got, want, atol, f"{what} {name}")


@pytest.mark.parametrize("cp", [2, 4])
@distributed(world_size=4)
def test_ulysses_equals_dense_sdpa(cp):
    """a2a at cp 2 and 4, a2a+ring at cp 4 with sub-groups of 2 (and the degenerate 1 and 4): fp64 ~1e-12 and fp32,
    forward and every gradient, MHA/GQA/MQA (kv heads replicated when fewer than the sub-group)."""
    mesh = tp.init_mesh(cp=cp)
    variants = [("a2a", None)] + ([("a2a+ring", 2), ("a2a+ring", 1), ("a2a+ring", 4)] if cp == 4 else
                                  [("a2a+ring", 1)])
    for mode, a2a_size in variants:
        for i, (heads, kv_heads) in enumerate(A2A_HEADS):
            check_mode(mesh, mode, heads, kv_heads, torch.float64, 1e-12, a2a_size=a2a_size, causal=i != 1, seed=i)
        check_mode(mesh, mode, 4, 2, torch.float32, 1e-5, a2a_size=a2a_size, seed=9)


@pytest.mark.parametrize("cp", [1, 2, 4])
@distributed(world_size=4)
def test_documents_equal_each_document_alone(cp):
    """A packed window's attention, in every mode, equals SDPA run on each document alone (fp64 ~1e-12, forward and
    q/k/v grads): a window starting mid-document, one-token documents, a document longer than the window, cp ranks
    whose share holds no document start; also every token its own document, and one document (plain causal)."""
    mesh = tp.init_mesh(cp=cp)
    s = 2 * cp * C
    cases = [documents(s, cp, seed=cp), torch.arange(2 * s).view(2, s), torch.full((2, s), 3)]
    variants = [("ring", None), ("allgather", None), ("a2a", None)] + ([("a2a+ring", 2)] if cp == 4 else [])
    for mode, a2a_size in variants:
        for j, docs in enumerate(cases):
            heads, kv_heads = A2A_HEADS[j + 1]
            check_mode(mesh, mode, heads, kv_heads, torch.float64, 1e-12, docs=docs, a2a_size=a2a_size, seed=j)
        check_mode(mesh, mode, 4, 2, torch.float32, 1e-5, docs=cases[0], a2a_size=a2a_size, seed=5)
        check_mode(mesh, mode, 4, 2, torch.float64, 1e-12, docs=cases[0], a2a_size=a2a_size, causal=False, seed=6)


@contextlib.contextmanager
def count_products(log):
    """Add each block's query x key products (b·heads·m·n) to log["forward"] / log["backward"]."""
    def counting(kind, fn):
        def count(q, k, *args):
            log[kind] += q.shape[:-1].numel() * k.shape[-2]
            return fn(q, k, *args)
        return count

    with mock.patch.object(blocks, "block_forward", counting("forward", blocks.block_forward)), \
            mock.patch.object(blocks, "block_backward", counting("backward", blocks.block_backward)):
        yield


@pytest.mark.parametrize("cp", [2, 4])
@distributed(world_size=4)
def test_blocks_documents_hide_are_skipped(cp):
    """Documents of one chunk each: a rank's queries see only its own chunks' keys, so the ring computes its step-0
    diagonal chunks and skips every other block (the KV still travels: other ranks need it), and all-gather cuts
    each chunk's key range to that chunk: 2c² products per head instead of (2cp + 1)·c², the same on every rank."""
    mesh = tp.init_mesh(cp=cp)
    b, heads, kv_heads, s = 2, 4, 2, 2 * cp * C
    docs = (torch.arange(s) // C).expand(b, s)
    for mode in KV_MODES:
        log = {"forward": 0, "backward": 0}
        with P2PCounter() as p2p, count_products(log):
            check_mode(mesh, mode, heads, kv_heads, torch.float64, 1e-12, docs=docs, seed=3)
        assert log == {"forward": b * heads * 2 * C * C, "backward": b * heads * 2 * C * C}, (mode, log)
        assert len(p2p.calls) == (3 * cp - 2 if mode == "ring" else 0)  # unchanged: cp−1 KV, cp−1 KV + cp dKV


class AllToAllCounter:
    """Records every dist.all_to_all_single: (bytes of the input, bytes that leave this rank)."""

    def __init__(self, group):
        self.calls, self.group = [], group

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        rank, rows = dist.get_rank(self.group), input.shape[0]
        splits = input_split_sizes or [rows // dist.get_world_size(self.group)] * dist.get_world_size(self.group)
        row = input.numel() // rows * input.element_size()
        self.calls.append((input.numel() * input.element_size(), sum(splits) * row - splits[rank] * row))
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    def __enter__(self):
        self.all_to_all_single = dist.all_to_all_single
        self._patch = mock.patch.object(dist, "all_to_all_single", self)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)


@distributed(world_size=4)
def test_ulysses_communication():
    """a2a: 4 all-to-alls forward (q, k, v in; out back) and 4 backward, no p2p, each sending (cp−1)/cp of its
    tensor; kv heads fewer than cp are replicated first. a2a+ring (cp 4, sub-groups of 2): the same 4 + 4 all-to-alls
    within the sub-group (half of each tensor leaves), plus the ring's p2p across the 2 sub-groups."""
    mesh = tp.init_mesh(cp=4)
    b, heads, kv_heads, n = 2, 8, 2, 2 * C
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(qkv_full(b, heads, kv_heads, n, torch.float32, 4)))
    for mode, a2a_size, kv_out in (("a2a", None, 4), ("a2a+ring", 2, 2)):
        a = a2a_size or 4
        with AllToAllCounter(mesh.cp_group) as a2a, P2PCounter() as p2p:
            out, fwd = comm_counts(lambda: tp.context_parallel_attention(q, k, v, mode=mode, a2a_size=a2a_size))
            forward_calls = a2a.calls[:]
            _, bwd = comm_counts(lambda: out.backward(dout))
        size = lambda h: b * h * n * D * 4  # noqa: E731  fp32 bytes of [b, h, n, d]
        expected = [(size(h), size(h) * (a - 1) // a) for h in (heads, kv_out, kv_out, heads)]
        assert forward_calls == expected, (mode, forward_calls)
        assert sorted(a2a.calls[4:]) == sorted(expected), (mode, a2a.calls[4:])  # dout, dq, dk, dv
        assert fwd["total"] == bwd["total"] == 4, (mode, fwd, bwd)  # all of them all-to-alls (the counter's)
        assert (len(p2p.calls) == 0) == (mode == "a2a"), p2p.calls
        if mode == "a2a+ring":  # a ring of 2 sub-groups: 1 KV message forward; 1 KV + 2 dKV backward
            peer = (mesh.cp_rank + 2) % 4
            assert [[op[2] for op in call] for call in p2p.calls] == [[peer, peer]] * 4


@distributed(world_size=4)
def test_bad_documents_and_head_splits_are_refused_before_any_communication():
    tp.init_mesh(cp=4)
    q, k = torch.zeros(2, 4, 6, 6), torch.zeros(2, 2, 6, 6)
    attention = functools.partial(tp.context_parallel_attention, q, k, k)
    cases = [
        (lambda: tp.context_parallel_attention(torch.zeros(2, 6, 6, 6), k, k, mode="a2a"),
         r"mode 'a2a' splits the heads over 4 ranks: heads=6 is not divisible by 4"),
        (lambda: attention(mode="a2a+ring"), r"mode 'a2a\+ring' needs a2a_size, a divisor of cp = 4; got None"),
        (lambda: attention(mode="a2a+ring", a2a_size=3), r"needs a2a_size, a divisor of cp = 4; got 3"),
        (lambda: attention(mode="ring", a2a_size=2), r"a2a_size=2 is for mode 'a2a\+ring', not 'ring'"),
        (lambda: tp.context_parallel_attention(torch.zeros(2, 12, 6, 6), torch.zeros(2, 3, 6, 6),
                                               torch.zeros(2, 3, 6, 6), mode="a2a"),
         r"kv_heads=3 neither divides nor is divisible by 4"),
        (lambda: attention(document_ids=torch.zeros(2, 6, dtype=torch.long)),
         r"document_ids must be \[b, s\] = \[2, 24\] \(the whole sequence, on every rank\), got \(2, 6\)"),
        (lambda: attention(document_ids=torch.zeros(2, 24)), r"document_ids must be integers, got torch.float32"),
    ]
    with CommDebugMode() as collectives, P2PCounter() as p2p, AllToAllCounter(None) as a2a:
        for fn, message in cases:
            with pytest.raises(ValueError, match=message):
                fn()
    assert collectives.get_total_counts() == 0 and p2p.calls == [] and a2a.calls == []


@distributed(world_size=2)
def test_the_ring_sends_device_tensors_through_host_buffers_over_gloo():
    """gloo's send and recv take host memory only: a CUDA tensor failed in the ring's first send ("writev: Bad
    address", H200 run 4, ranks sharing the GPU over gloo). tp.collectives stages a device tensor through a host copy
    and lands each receive on wait(); here the CPU counts as such a device, so the landing is what the ring reads."""
    landed = []
    land = tp.collectives._Landing.wait
    counted = lambda self: landed.extend(t is not None for _, t in self.pairs) or land(self)  # True: a receive
    with mock.patch.object(tp.collectives, "GLOO_P2P_DEVICES", ()), \
            mock.patch.object(tp.collectives._Landing, "wait", counted):
        check_against_dense(tp.init_mesh(cp=2), "ring", True, 4, 2, 1, torch.float64, 1e-12)
    assert sum(landed) == 4 and len(landed) == 8  # cp = 2, receives and sends: the forward's KV; the backward's
                                                  # KV and its dKV after each of two steps


@distributed(world_size=1)
def test_a_coalesced_batch_lands_every_staged_receive_after_its_one_work():
    """A backend may coalesce a batch into one work (NCCL's coalescing manager does): the staged receives then land
    when that work is waited, not one per op."""
    from types import SimpleNamespace

    recv, send = torch.zeros(3), torch.ones(3)

    def coalesced(ops):
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.fill_(7.0)  # (the backend writes the host buffer)
        return [SimpleNamespace(wait=lambda: True)]

    with mock.patch.object(tp.collectives, "GLOO_P2P_DEVICES", ()), \
            mock.patch.object(dist, "batch_isend_irecv", coalesced):
        works = tp.collectives.batch_isend_irecv([dist.P2POp(dist.isend, send, 0), dist.P2POp(dist.irecv, recv, 0)])
    assert len(works) == 1 and not recv.any()
    works[0].wait()
    assert torch.equal(recv, torch.full((3,), 7.0))
