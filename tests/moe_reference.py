"""A dense mixture-of-experts reference written from the definitions (Hugging Face's expert loop), helpers that
gather a parallel MoE layer's weights and gradients into their dense form, and the margin of a routing: how far its
discrete decisions are from flipping."""
import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def route(x, router, topk, score="softmax", norm=True, bias=None):
    """(weights [T, k] fp32, indices [T, k], probs for the aux loss [T, E], logits [T, E]); the choice and weights in
    fp32 (Hugging Face's routers), the aux-loss inputs at x's precision (fp32 at least)."""
    raw = F.linear(x, router)
    logits = raw.float()
    hi = raw if raw.dtype == torch.float64 else logits
    weights, indices = choose(logits, topk, score, norm, bias)
    probs = hi.softmax(-1) if score == "softmax" else hi.sigmoid() / hi.sigmoid().sum(-1, keepdim=True)
    return weights, indices, probs, hi


def choose(logits, topk, score="softmax", norm=True, bias=None):
    """(weights [T, k], indices [T, k]): the experts fp32 logits [T, E] pick and their combine weights."""
    if score == "softmax":
        weights, indices = logits.softmax(-1).topk(topk, dim=-1)
    else:
        scores = logits.sigmoid()
        indices = (scores.detach() + (0 if bias is None else bias)).topk(topk, dim=-1).indices
        weights = scores.gather(-1, indices)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, indices


def capacity_kept(weights, indices, num_experts, capacity_factor):
    """Each expert keeps its C = ceil(T·k/E·cf) slots of highest weight, equal weights in row order (the rows being
    the tokens in their global order)."""
    cap = _capacity(weights, num_experts, capacity_factor)
    kept = torch.zeros_like(indices, dtype=torch.bool)
    w = weights.detach().float()
    for e in range(num_experts):
        token, slot = torch.where(indices == e)  # (row-major: tokens in order)
        best = w[token, slot].sort(descending=True, stable=True).indices[:cap]
        kept[token[best], slot[best]] = True
    return kept


def _capacity(weights, num_experts, capacity_factor):
    return math.ceil(weights.shape[0] * weights.shape[1] / num_experts * capacity_factor)


def expert_ffn(x, fc1, fc2, activation):
    z = F.linear(x, fc1)
    if activation == "swiglu":
        gate, up = z.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")
    return F.linear(h, fc2)


def reference_moe(x, w, *, topk, score="softmax", norm=True, activation="swiglu", capacity_factor=None,
                  aux_coeff=0.0, z_coeff=0.0, bias=None, ffn=expert_ffn):
    """(out [T, h], aux + z, load-balancing loss, z loss) for the global tokens x [T, h] and dense weights w (dict:
    router, fc1 [E, 2F, h], fc2 [E, h, F], optional shared_fc1, shared_fc2, shared_gate); `ffn(x, fc1, fc2,
    activation)` computes one expert (and the shared one)."""
    E = w["router"].shape[0]
    weights, indices, probs, logits = route(x, w["router"], topk, score, norm, bias)
    kept = capacity_kept(weights, indices, E, capacity_factor) if capacity_factor else torch.ones_like(
        indices, dtype=torch.bool)
    out = torch.zeros_like(x)
    for e in range(E):
        token, slot = torch.where((indices == e) & kept)
        y = ffn(x[token], w["fc1"][e], w["fc2"][e], activation)
        out = out.index_add(0, token, y * weights[token, slot, None].to(x.dtype))
    if "shared_fc1" in w:
        shared = ffn(x, w["shared_fc1"], w["shared_fc2"], activation)
        if "shared_gate" in w:
            shared = torch.sigmoid(x @ w["shared_gate"].t()) * shared
        out = out + shared
    counts = torch.bincount(indices.flatten(), minlength=E).double()
    T = x.shape[0]
    lb = aux_coeff * E * ((counts / (T * topk)) * probs.double().mean(0)).sum()
    z = z_coeff * torch.logsumexp(logits.double(), -1).square().mean()
    return out, lb + z, lb, z


# ---- a parallel layer's weights (or grads) gathered into the dense form -----------------------------------------


def _all_gather(t, group):
    if group is None or dist.get_world_size(group) == 1:
        return [t]
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, t.contiguous(), group=group)
    return pieces


def dense_experts(moe, grads=False):
    """(fc1 [E, rows, h], fc2 [E, h, F]) of every expert, gathered over etp and ep (collective)."""
    ex = moe.experts
    fc1 = ex.fc1.grad if grads else ex.fc1.detach()
    fc2 = ex.fc2.grad if grads else ex.fc2.detach()
    fc1 = _all_gather(fc1, moe.etp_group)
    if ex.activation == "swiglu":
        fc1 = torch.cat([torch.cat([p.chunk(2, 1)[part] for p in fc1], 1) for part in (0, 1)], 1)
    else:
        fc1 = torch.cat(fc1, 1)
    fc2 = torch.cat(_all_gather(fc2, moe.etp_group), 2)
    return torch.cat(_all_gather(fc1, moe.ep_group), 0), torch.cat(_all_gather(fc2, moe.ep_group), 0)


def dense_weights(moe, grads=False):
    """The dense weights dict reference_moe takes (grads=True: the gradients, each as this rank holds it)."""
    get = (lambda p: p.grad) if grads else (lambda p: p.detach())
    fc1, fc2 = dense_experts(moe, grads)
    out = {"router": get(moe.router.weight), "fc1": fc1, "fc2": fc2}
    if moe.shared is not None:
        s = moe.shared
        out["shared_fc1"] = s.fc1.gather_dense(get(s.fc1.weight))
        out["shared_fc2"] = s.fc2.gather_dense(get(s.fc2.weight))
        if s.gate is not None:
            out["shared_gate"] = get(s.gate)
    return out


# ---- how far a routing is from flipping ------------------------------------------------------------------------------
# Routing is discrete: a token's k-th and (k+1)-th experts, an over-full expert's C-th and (C+1)-th slots. Two fp32
# computations of one routing (a split and the one-rank model, ours and Hugging Face's, another machine's kernels)
# give scores (probabilities, in [0, 1]) ~1e-7 apart: their logits round apart by ~1e-7 relative (through upstream
# layers too, whose outputs these tests compare to 1e-5), passed through a softmax or sigmoid whose slope is at most
# 1/4, plus the scores' own rounding (6e-8); any decision closer than that can go either way, on one machine and not
# another. Where fp32 results are compared across such computations, the test asserts the reference's margin is at
# least MARGIN, 100x that: both sides then decide alike on any machine. (fp64 models need no check: their logits agree
# to ~1e-16, and the router's fp32 rounding of them gives the same fp32 logits unless one lies within ~1e-16 of a
# rounding boundary, a chance of ~1e-9 a logit.)

MARGIN = 1e-5


def routing_margin(logits, topk, *, score="softmax", norm=True, bias=None, capacity_factor=None):
    """The smallest gap between the two sides of any decision routing `logits` [T, E] (its T tokens: the group the
    capacity counts over) makes, in the router's fp32 units: each token's k-th and (k+1)-th selection scores, and with
    a capacity factor each over-full expert's C-th and (C+1)-th combine weights (0 for a tie at the cut)."""
    logits = logits.detach().float()
    selection = logits.softmax(-1) if score == "softmax" else logits.sigmoid() + (0 if bias is None else bias)
    ordered = selection.sort(-1, descending=True).values
    gaps = [(ordered[:, topk - 1] - ordered[:, topk]).min().item()] if topk < logits.shape[-1] else []
    if capacity_factor:
        weights, indices = choose(logits, topk, score, norm, bias)
        cap = _capacity(weights, logits.shape[-1], capacity_factor)
        for e in range(logits.shape[-1]):
            mine = weights[indices == e].sort(descending=True).values
            if mine.numel() > cap:
                gaps.append((mine[cap - 1] - mine[cap]).item())
    return min(gaps, default=math.inf)


@contextlib.contextmanager
def routing_margins(model, capacity_factor=None):
    """The routing_margin of every routing `model`'s routers (tp.moe.TopKRouter) make inside the block: a list filled
    as they run (on a one-rank model, each routing covers its micro-batch: the tokens the capacity counts over)."""
    import tp

    margins = []

    def record(router, _, routing):
        margins.append(routing_margin(routing.logits, router.topk, score=router.score, norm=router.norm_topk_prob,
                                      bias=router.expert_bias, capacity_factor=capacity_factor))

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, tp.moe.TopKRouter)]
    try:
        yield margins
    finally:
        for hook in hooks:
            hook.remove()
