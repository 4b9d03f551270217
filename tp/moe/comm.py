"""The token dispatch's collectives, as two custom ops (torch.library) that are each other's backward, sized by a
count table every rank of the etp·ep group holds on the host.

- `tp_moe::dispatch`: this rank's routed slots, sorted by global expert, to the ranks holding their experts (one
  all-to-all-v over ep), then all-gathered over etp and sorted by local expert: the grouped GEMM's input.
- `tp_moe::combine`: the inverse: unsorted, reduce-scattered over etp (the etp ranks' partial sums), all-to-all-v
  back; rows past the ones sent (dropped slots) come back as zeros.

The split sizes are host integers read from the table, a CPU int64 tensor [etp, ep, E] (how many slots rank (etp,
ep) routes to global expert e): on the CPU already, reading it costs no device sync, and torch.compile keeps each op
whole: its output's row count is a data-dependent size (an unbacked SymInt), so nothing breaks the graph. The
all-to-all-v is `all_to_all_single` with uneven splits; the etp all-gather (reduce-scatter) of chunks whose sizes
differ per rank is a padded all_gather_into_tensor (reduce_scatter_tensor) of the largest chunk. Groups travel as
their names (an op takes no ProcessGroup), "" for none.
"""
import torch
import torch.distributed as dist

from ..collectives import all_gather_into_tensor, reduce_scatter_tensor
from ..host_syncs import host_values


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name a custom op takes for `group` ("" for no group or a group of one rank)."""
    return "" if group is None or dist.get_world_size(group) == 1 else group.group_name


def _group(name):
    return None if not name else dist.distributed_c10d._resolve_process_group(name)


def _rank(group):
    return 0 if group is None else dist.get_rank(group)


class Plan:
    """Where this rank's routed slots go and come from, from the count table (host integers)."""

    def __init__(self, table: torch.Tensor, ep_rank: int, etp_rank: int) -> None:
        table = host_values(table)  # [etp][ep][e]: how many slots the rank (etp, ep) routes to global expert e
        L = len(table[0][0]) // len(table[0])
        mine = slice(ep_rank * L, (ep_rank + 1) * L)
        row = table[etp_rank][ep_rank]
        self.local_experts, self.etp, self.ep = L, len(table), len(table[0])
        self.input_splits = [sum(row[j * L:(j + 1) * L]) for j in range(self.ep)]
        self.output_splits = [sum(table[etp_rank][i][mine]) for i in range(self.ep)]
        self.etp_sizes = [sum(sum(src[mine]) for src in per_etp) for per_etp in table]
        # the rows after the etp gather, chunk (etp r, source ep i, local expert e): their sizes, in that order
        self.chunks = [n for per_etp in table for src in per_etp for n in src[mine]]

    def expert_major(self, device: torch.device) -> torch.Tensor | None:
        """The permutation sorting the gathered rows (etp r, source i, expert e) by (e, r, i); None: already so."""
        if self.etp * self.ep == 1 or self.local_experts == 1:
            return None
        sizes = torch.tensor(self.chunks, device=device)
        r, i, e = torch.meshgrid(*(torch.arange(n, device=device) for n in (self.etp, self.ep, self.local_experts)),
                                 indexing="ij")
        key = (e * self.etp * self.ep + r * self.ep + i).flatten()
        return torch.repeat_interleave(key, sizes, output_size=sum(self.chunks)).argsort(stable=True)


def _plan(table, ep_group, etp_group):
    return Plan(table, _rank(ep_group), _rank(etp_group))


def _all_to_all(x, output_splits, input_splits, group, rows=None):
    """Rows input_splits[j] of x go to rank j; rows output_splits[i] arrive from rank i (into the first rows of a
    [rows, ...] output whose other rows are zero)."""
    received = sum(output_splits)
    out = x.new_empty(received if rows is None else rows, *x.shape[1:])
    out[received:].zero_()
    dist.all_to_all_single(out[:received], x[:sum(input_splits)].contiguous(), output_splits, input_splits,
                           group=group)
    return out


def _gather_v(x, sizes, group):
    most = max(sizes)
    if most == 0:
        return x.new_empty(0, *x.shape[1:])
    padded = x.new_zeros(most, *x.shape[1:])
    padded[:x.shape[0]] = x
    out = x.new_empty(most * len(sizes), *x.shape[1:])
    all_gather_into_tensor(out, padded, group=group)
    return torch.cat([chunk[:n] for chunk, n in zip(out.split(most), sizes)])


def _reduce_scatter_v(x, sizes, group):
    most = max(sizes)
    if most == 0:
        return x.new_empty(0, *x.shape[1:])
    padded = x.new_zeros(most * len(sizes), *x.shape[1:])
    for chunk, piece in zip(padded.split(most), x.split(sizes)):
        chunk[:piece.shape[0]] = piece
    out = x.new_empty(most, *x.shape[1:])
    reduce_scatter_tensor(out, padded, group=group)
    return out[:sizes[dist.get_rank(group)]]


def _dispatch(x: torch.Tensor, table: torch.Tensor, ep_group: str, etp_group: str, rows: int) -> torch.Tensor:
    ep, etp = _group(ep_group), _group(etp_group)
    plan = _plan(table, ep, etp)
    out = _all_to_all(x, plan.output_splits, plan.input_splits, ep) if ep else x[:sum(plan.input_splits)]
    if etp:
        out = _gather_v(out, plan.etp_sizes, etp)
    order = plan.expert_major(x.device)
    if order is not None:
        return out.index_select(0, order)
    return out if ep or etp else out.clone()  # (an op's output may not alias its input)


def _combine(y: torch.Tensor, table: torch.Tensor, ep_group: str, etp_group: str, rows: int) -> torch.Tensor:
    ep, etp = _group(ep_group), _group(etp_group)
    plan = _plan(table, ep, etp)
    order = plan.expert_major(y.device)
    if order is not None:
        y = y.new_zeros(y.shape).index_copy(0, order, y)  # the inverse permutation
    if etp:
        y = _reduce_scatter_v(y, plan.etp_sizes, etp)
    if ep:
        return _all_to_all(y, plan.input_splits, plan.output_splits, ep, rows)
    out = y.new_zeros(rows, *y.shape[1:])
    out[:y.shape[0]] = y
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, table, ep_group, etp_group, rows):
        ctx.args = (table, ep_group, etp_group, x.shape[0])
        return _dispatch(x, table, ep_group, etp_group, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return _combine(grad, *ctx.args), None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, table, ep_group, etp_group, rows):
        ctx.args = (table, ep_group, etp_group, y.shape[0])
        return _combine(y, table, ep_group, etp_group, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return _dispatch(grad.contiguous(), *ctx.args), None, None, None, None


# Under torch.compile the same two functions run as custom ops (eager calls them directly: no op dispatch overhead,
# and a CommDebugMode sees their collectives).
_dispatch_op = torch.library.custom_op("tp_moe::dispatch", _dispatch, mutates_args=())
_combine_op = torch.library.custom_op("tp_moe::combine", _combine, mutates_args=())


@_dispatch_op.register_fake
def _(x, table, ep_group, etp_group, rows):
    return x.new_empty(torch.library.get_ctx().new_dynamic_size() if rows < 0 else rows, x.shape[1])


@_combine_op.register_fake
def _(y, table, ep_group, etp_group, rows):
    return y.new_empty(rows, y.shape[1])


def _save_rows(ctx, inputs, output):
    x, table, ep_group, etp_group, _ = inputs
    ctx.save_for_backward(table)
    ctx.groups, ctx.rows = (ep_group, etp_group), x.shape[0]


def _dispatch_backward(ctx, grad):
    return _combine_op(grad, *ctx.saved_tensors, *ctx.groups, ctx.rows), None, None, None, None


def _combine_backward(ctx, grad):
    return _dispatch_op(grad.contiguous(), *ctx.saved_tensors, *ctx.groups, ctx.rows), None, None, None, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_save_rows)
_combine_op.register_autograd(_combine_backward, setup_context=_save_rows)


def dispatch(x: torch.Tensor, table: torch.Tensor, ep_group: str, etp_group: str) -> torch.Tensor:
    """x [n, h]: this rank's slots sorted by global expert (the first Σ table[etp_rank, ep_rank] rows are sent) ->
    [m, h]: the rows of this rank's experts from every rank of the etp·ep group, sorted by local expert
    (backward: combine)."""
    fn = _dispatch_op if torch.compiler.is_compiling() else _Dispatch.apply
    return fn(x, table, ep_group, etp_group, -1)


def combine(y: torch.Tensor, table: torch.Tensor, ep_group: str, etp_group: str, rows: int) -> torch.Tensor:
    """dispatch's inverse (and backward): y [m, h] (partial sums over etp), sorted by local expert -> [rows, h], the
    outputs of this rank's slots in the order dispatch took them, zero rows past the ones it sent."""
    fn = _combine_op if torch.compiler.is_compiling() else _Combine.apply
    return fn(y, table, ep_group, etp_group, rows)
