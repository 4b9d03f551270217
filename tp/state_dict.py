"""A tensor-parallel module's state dicts under the names, shapes and layout it had before `tp.parallelize` (a model
built from the layers: their dense shapes): dense (`full_state_dict`, gathered; `load_full_state_dict`, sliced) and
sharded for torch's distributed checkpoint (`sharded_state_dict`: each rank's blocks placed in the dense tensors)."""
import itertools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .moe import GroupedExperts

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, GroupedExperts)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with every tensor-parallel parameter gathered to its dense shape, under the same
    names and layout as before `parallelize` (HF Conv1D weights back to [in, out]), for the module `parallelize`
    was given or any module containing it. A collective: every rank of the tp group calls it; every rank gets the
    dense tensors. Under FSDP2 (DTensor parameters) each is gathered over its data-parallel mesh first."""
    state = {key: value.full_tensor() if hasattr(value, "full_tensor") else value  # (FSDP2's DTensors)
             for key, value in module.state_dict().items()}
    gathered = {}  # tied parameters (embedding and lm_head) gathered once, still one tensor
    for key, sub, pname, param in _parallel_parameters(module, state):
        if id(param) not in gathered:
            local = state[key]
            dense = sub.gather_dense(local, pname) if isinstance(sub, GroupedExperts) else sub.gather_dense(local)
            gathered[id(param)] = dense.t().contiguous() if _conv1d_weight(sub, pname) else dense
        state[key] = gathered[id(param)]
    return state


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a dense state dict (full_state_dict's, or the model's before `parallelize`: the same names, shapes and
    layout) into a parallelized module: each rank keeps its shards of the tensor-parallel parameters (its experts'
    under ep). A tied weight saved once (safetensors keeps one name of shared tensors) fills every name it has. A
    dense shape the layer does not have is a ValueError naming the key. No collective; call it before wrapping the
    module in FSDP2. `strict` as in `load_state_dict`."""
    if (name := fsdp_sharded(module)) is not None:
        raise ValueError(f"load_full_state_dict: {name} is FSDP2's DTensor: load the dense state dict before "
                         "fully_shard")
    local = dict(state_dict)
    for names in _tied_names(module):
        given = next((name for name in names if name in state_dict), None)
        local |= {name: state_dict[given] for name in names if given is not None and name not in state_dict}
    for key, sub, pname, _ in _parallel_parameters(module, local):
        dense = local[key].t() if _conv1d_weight(sub, pname) else local[key]
        expected = _dense_shape(sub, pname)
        if tuple(dense.shape) != expected:
            raise ValueError(f"load_full_state_dict: {key} has shape {tuple(local[key].shape)}, the dense "
                             f"{type(sub).__name__}'s is {expected if dense is local[key] else expected[::-1]}")
        if isinstance(sub, GroupedExperts):
            mine = dense[sub.expert_range.start:sub.expert_range.stop]
            local[key] = sub.shard_fc1(mine) if pname == sub.names[0] else sub.shard_fc2(mine)
        elif isinstance(sub, VocabParallelEmbedding):
            local[key] = dense[sub.vocab_start:sub.vocab_end]
        elif not (isinstance(sub, RowParallelLinear) and pname == "bias"):  # (a row layer's bias is whole)
            local[key] = sub.shard_dense(dense)
    module.load_state_dict(local, strict=strict)


def fsdp_sharded(module: nn.Module) -> str | None:
    """The name of the module's first parameter that is a DTensor (FSDP2 has sharded it), or None."""
    return next((name for name, p in module.named_parameters() if isinstance(p, DTensor)), None)


def _dense_shape(sub, pname):
    """The dense shape of tensor-parallel layer `sub`'s parameter `pname` (experts: [E, ...] over every expert)."""
    if isinstance(sub, GroupedExperts):
        return (sub.num_experts, _fc1_rows(sub), sub.hidden_size) if pname == sub.names[0] else \
            (sub.num_experts, sub.hidden_size, sub.ffn_hidden_size)
    if isinstance(sub, VocabParallelEmbedding):
        return sub.num_embeddings, sub.embedding_dim
    return (sub.out_features, sub.in_features) if pname == "weight" else (sub.out_features,)


def _tied_names(module):
    """The names of each parameter that has more than one (a tied embedding and output layer)."""
    names = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _parallel_parameters(module, state):
    """(state key, tp layer, parameter name, parameter) of every tensor-parallel parameter of `module` in `state`,
    under its state-dict names (wrappers such as torch's checkpoint_wrapper drop their own from those)."""
    keys = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if key in state:
            keys.setdefault(id(value), []).append(key)
    for sub in module.modules():
        if isinstance(sub, _TP_LAYERS):
            for pname, param in sub.named_parameters(recurse=False):
                for key in keys.pop(id(param), ()):  # (a weight two layers share: under each of its names, once)
                    yield key, sub, pname, param


def _conv1d_weight(sub, pname):
    return getattr(sub, "_tp_from_conv1d", False) and pname == "weight"


def _fc1_rows(experts):
    """The dense rows of each expert's fc1: gate and up (SwiGLU), else the FFN's."""
    return 2 * experts.ffn_hidden_size if experts.activation == "swiglu" else experts.ffn_hidden_size


def sharded_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict for torch's distributed checkpoint (`dcp.save`, `dcp.load`): each tensor-parallel
    parameter a DTensor of its dense shape (full_state_dict's names, shapes and layout) made of this rank's blocks of
    it, views of the parameter. `dcp.save` writes each dense block once (kv rows several ranks hold included);
    `dcp.load` reads the blocks this rank holds into the parameters in place, from a checkpoint written at any tp /
    ep / etp split or by the dense model (and the dense model loads it as it loads its own). Under FSDP2, this rank's
    dp shard of its tp shard. No collective."""
    state, meshes = module.state_dict(), {}
    if not dist.is_initialized():  # (no process group: every layer is whole)
        return state
    for key, sub, pname, _ in _parallel_parameters(module, state):
        _put_sharded(state, key, sub, pname, meshes)
    return state


def _put_sharded(state, key, sub, pname, meshes):
    """state[key] (`sub`'s parameter `pname`, or state shaped like it) made _sharded; dropped where this rank holds
    none of it (an FSDP2 shard with no rows: nothing to save or load here)."""
    sharded = _sharded(state[key], sub, pname, _world_mesh(meshes, state[key].device.type))
    if sharded is None:
        del state[key]
    else:
        state[key] = sharded


def _sharded(value, sub, pname, mesh):
    """`value` (`sub`'s tp-local parameter `pname`, or FSDP2's DTensor of it) as a DTensor of the dense tensor whose
    local chunks are this rank's blocks of it (views), or None if it holds none; a whole parameter as it is."""
    local, indices = value, _dense_indices(sub, pname)
    if all(i is None for i in indices):  # whole on every tp rank (a row layer's bias): DCP saves it once as it is
        return value
    if isinstance(value, DTensor):  # FSDP2: this rank's [offset, offset + size) of the tp-local tensor per dim
        local = value.to_local()
        _, start = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        indices = [(torch.arange(n, device="cpu") if i is None else i)[s:s + size]
                   for i, n, s, size in zip(indices, value.shape, start, local.shape)]
    fused_dim, starts = _part_starts(sub, pname)
    runs = [[(0, n, 0)] if i is None else _runs(i, starts if d == fused_dim else ())
            for d, (i, n) in enumerate(zip(indices, local.shape))]
    transposed = _conv1d_weight(sub, pname)  # stored [in, out]
    pieces, offsets = [], []
    for block in itertools.product(*runs):
        piece = local
        for dim, (start, length, _) in enumerate(block):
            piece = piece.narrow(dim, start, length)
        offset = tuple(dense for *_, dense in block)
        pieces.append(piece.t() if transposed else piece)
        offsets.append(offset[::-1] if transposed else offset)
    if not pieces:
        return None
    shape = torch.Size(_dense_shape(sub, pname)[::-1] if transposed else _dense_shape(sub, pname))
    dim = next(d for d, i in enumerate(indices) if i is not None)
    spec = DTensorSpec(mesh, (Shard(1 - dim if transposed else dim),),  # (DTensor.from_local's view_as fails on
                       tensor_meta=TensorMeta(shape, torch.empty(shape, device="meta").stride(), local.dtype))  # 3-D)
    return DTensor(LocalShardsWrapper(pieces, offsets), spec, requires_grad=False)


def _world_mesh(meshes, device_type):
    """A 1-D mesh over every rank, one per device type (`meshes`): the sharded DTensors' (DCP reads only their local
    chunks, whatever their mesh)."""
    if device_type not in meshes:
        meshes[device_type] = DeviceMesh.from_group(dist.group.WORLD, device_type)
    return meshes[device_type]


def _dense_indices(sub, pname):
    """Per dim of `sub`'s tp-local parameter `pname`: the dense indices its positions hold (None: all, in order)."""
    if isinstance(sub, GroupedExperts):  # [E/ep, 2F/etp (gate, up), h] / [E/ep, h, F/etp]
        experts = torch.arange(sub.expert_range.start, sub.expert_range.stop, device="cpu")
        if pname == sub.names[0]:
            return [experts, sub.shard_fc1(torch.arange(_fc1_rows(sub), device="cpu")[:, None])[:, 0], None]
        return [experts, None, sub.shard_fc2(torch.arange(sub.ffn_hidden_size, device="cpu"))]
    if isinstance(sub, VocabParallelEmbedding):
        return [torch.arange(sub.vocab_start, sub.vocab_end, device="cpu"), None]
    if isinstance(sub, RowParallelLinear) and pname == "bias":
        return [None]  # (whole on every rank)
    indices = [None, None] if pname == "weight" else [None]
    indices[sub.shard_dim if pname == "weight" else 0] = sub.shard_indices()
    return indices


def _part_starts(sub, pname):
    """(dim, the dense indices where each fused part after the first starts) of a fused parameter (q|k|v, gate|up):
    a run of rows stops there, so replicated kv rows make the same chunks on every rank that holds them (one kv head
    at tp 2: a rank's q rows run on into k and v, another's do not, and DCP refuses overlapping chunks)."""
    if isinstance(sub, GroupedExperts):
        return 1, ({sub.ffn_hidden_size} if pname == sub.names[0] and sub.activation == "swiglu" else set())
    if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
        return (sub.shard_dim if pname == "weight" else 0), set(itertools.accumulate(sub.parts[:-1]))
    return 0, set()


def _runs(indices, starts=()):
    """(local start, length, dense start) of each run of consecutive dense indices in `indices` (a new run at each
    of `starts`)."""
    runs, position = [], 0
    for start, stop in index_runs(indices, starts):
        runs.append((position, stop - start, start))
        position += stop - start
    return runs


def index_runs(indices: torch.Tensor, starts: Iterable[int] = ()) -> list[list[int]]:
    """Consecutive runs [(start, stop)] of a 1-D index tensor, in order (a new one at each index in `starts`)."""
    runs, starts = [], set(starts)
    for i in indices.tolist():
        if runs and runs[-1][1] == i and i not in starts:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


class ShardedOptimizerState:
    """`optimizer`'s state for torch's DCP beside `sharded_state_dict(module)`: a Stateful (DCP calls state_dict() to
    save, and load_state_dict() after loading into it), under a key of the checkpoint's dict. Its state dict is
    torch's flattened `get_optimizer_state_dict(module, optimizer)` ("state.<name>.<entry>", "param_groups.<name>.
    <hyperparameter>": every pipeline stage's own keys; the state made first if the optimizer has not stepped, as
    torch does) with each state tensor of a tensor-parallel parameter made a DTensor of the dense shape as
    sharded_state_dict makes the parameter: views of the state, so `dcp.load` reads this rank's blocks in place, from
    a checkpoint of any tp / ep / etp split or of the dense model. No collective."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from .optim import DistributedOptimizer

        if isinstance(optimizer, DistributedOptimizer):  # (its parameters are master shards, not the module's)
            raise TypeError("ShardedOptimizerState takes a torch optimizer over the module's parameters; a "
                            "tp.optim.DistributedOptimizer checkpoints through its state_dict() (this rank's shard, "
                            "the same layout) or full_state() / load_full_state() (whole tensors)")
        self.module, self.optimizer = module, optimizer
        self._local = {}  # state key -> the state tensor a sharded view stands for

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # flattened: each pipeline stage's keys its own (nested, every stage's param_groups.0.params collide)
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        state, self._local = get_optimizer_state_dict(self.module, self.optimizer, options=flat), {}
        if not dist.is_initialized():
            return state
        layers, meshes = self._tp_parameters(), {}
        for key in [k for k in state if k.startswith("state.")]:
            name, _, entry = key[len("state."):].rpartition(".")
            value = state[key]
            if name not in layers or not torch.is_tensor(value) or value.dim() == 0:  # (AdamW's step: whole)
                continue
            sub, pname, param = layers[name]
            if value.shape != param.shape:  # (Adafactor's row / column statistics): no dense form to place it in
                raise ValueError(f"ShardedOptimizerState: {name}'s {entry!r} has shape {tuple(value.shape)}, not its "
                                 f"tensor-parallel parameter's {tuple(param.shape)}: it cannot be resharded")
            self._local[key] = value
            _put_sharded(state, key, sub, pname, meshes)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand what DCP loaded to the optimizer (the sharded tensors were read into its state in place)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state_dict | self._local,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))

    def _tp_parameters(self):
        """{torch's name of the parameter (no DDP, compile or wrapper prefixes): (tp layer, its name, parameter)}."""
        from torch.distributed.checkpoint.state_dict import _get_fqns

        names = {id(p): next(iter(_get_fqns(self.module, name))) for name, p in self.module.named_parameters()}
        return {names[id(p)]: (sub, pname, p) for sub in self.module.modules() if isinstance(sub, _TP_LAYERS)
                for pname, p in sub.named_parameters(recurse=False) if id(p) in names}
