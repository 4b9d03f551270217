"""Context parallelism: cp_shard / cp_unshard / cp_positions and context_parallel_attention against dense SDPA on the
full tensors (fp64 ~1e-12, fp32 ~1e-5, bf16 vs fp64), the p2p and collective traffic, memory, and causal balance."""
import contextlib
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
from tp import context
from tp.testing import distributed

from .helpers import assert_close, comm_counts, randn

C, D = 3, 6  # tokens per chunk (s = 2·cp·C) and head dim: odd-ish sizes
HEADS = [(4, 4), (4, 2), (3, 1)]  # MHA, GQA, MQA
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


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
    for mode in context.MODES:
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
    for mode in context.MODES:
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
    for mode in context.MODES:
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
    for mode in context.MODES:
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

    with mock.patch.object(context, "_block_forward", logging(context._block_forward)), \
            mock.patch.object(context, "_block_backward", logging(context._block_backward)):
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
    for mode in context.MODES:
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
    for mode in context.MODES:
        products = {"forward": 0, "backward": 0}

        def counting(name, fn):
            def count(q, k, *args):
                products[name] += q.shape[:-1].numel() * k.shape[-2]  # b·heads·m·n
                return fn(q, k, *args)
            return count

        with mock.patch.object(context, "_block_forward", counting("forward", context._block_forward)), \
                mock.patch.object(context, "_block_backward", counting("backward", context._block_backward)):
            tp.context_parallel_attention(q, k, v, causal=causal, mode=mode).backward(dout)
        per_rank = [None] * 4
        dist.all_gather_object(per_rank, products, group=mesh.cp_group)
        assert all(p == products for p in per_rank), (mode, per_rank)
        # causal: (2cp + 1)·c² on every rank. ring: c² + 2c² at step 0, then c·n = 2c² per step;
        # allgather: chunk r vs (r+1)·c keys, chunk 2cp−1−r vs (2cp−r)·c
        expected = C * C * (2 * 4 + 1) if causal else 4 * n * n
        assert products == {"forward": b * heads * expected, "backward": b * heads * expected}, (mode, products)


def test_a_fully_masked_block_gives_no_nan():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 1, 2, *shape, generator=g, dtype=torch.float64)
                     for shape in ((3, 4), (2, 4), (2, 4), (3, 4)))
    k, v = k[:, :, 0], v[:, :, 0]  # [b, kv_heads, n, d]
    # 3 queries aligned to the last 2 keys: query 0 sees none of them
    out, lse = context._block_forward(q, k, v, 0.5, True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[..., 0, :] == 0).all() and (lse[..., 0] == -math.inf).all() and lse[..., 1:].isfinite().all()
    acc_out, acc_lse = torch.zeros_like(out), torch.full_like(lse, -math.inf)
    context._merge(acc_out, acc_lse, out, lse)  # a fully masked row merged into an empty one stays empty
    assert torch.equal(acc_out, out) and torch.equal(acc_lse, lse)
    delta = (dout * out).sum(-1)
    grads = context._block_backward(q, k, v, dout, lse, delta, 0.5, True)
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
    ]
    with CommDebugMode() as collectives, P2PCounter() as p2p:
        for fn, message in cases:
            with pytest.raises(ValueError, match=message):
                fn()
    assert collectives.get_total_counts() == 0 and p2p.calls == []
