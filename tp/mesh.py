"""The hybrid mesh (`tp.init_mesh`): every process group of one layout (tp/mesh_layout.py: the rank groups per
axis, Megatron's rank order) created once, seen from this rank; the current mesh that layers use when no group is
passed; `SharedGroup`, a module's process group that deep copies share."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .default_group import (
    collective_device,
    default_backend,
    default_group_timeout,
    init_default_group,
    launched_by_torchrun,
    lone_process_error,
)
from .mesh_layout import (
    AXES,
    COMPOSITES,
    DEFAULT_ORDER,
    EXPERT_AXES,
    EXPERT_GROUPS,
    dense_sizes,
    expert_order,
    expert_sizes,
    layout,
    parse_order,
)
from .slurm import use_srun_environment

__all__ = ["AXES", "COMPOSITES", "DEFAULT_ORDER", "EXPERT_AXES", "EXPERT_GROUPS", "Mesh", "SharedGroup",
           "collective_device", "current_mesh", "default_backend", "destroy_mesh", "get_mesh", "init_mesh",
           "launched_by_torchrun", "layout", "resolve_cp_group", "resolve_group"]

_current = None
# Process groups kept by destroy_mesh(keep_groups=True) for the next init_mesh, keyed by their ranks, valid while
# the default group they were made under (the first entry) lives.
_kept_groups = [None, {}]
# Set when a mesh destroyed its groups: the next mesh synchronises every rank before creating its own. Gloo groups
# torn down or created while another rank is still at the other step sometimes fail the next group's connection
# ("Gloo connectFullMesh failed ... Connection closed by peer": about 1 in 40 destroy/init cycles on a loaded 2-core
# machine; none in 320 with a barrier before the teardown and one before the next groups).
_destroyed_groups = [False]


def _embedding_ranks(pp_ranks):
    return sorted({pp_ranks[0], pp_ranks[-1]})


class Mesh:
    """Process groups of one hybrid layout, seen from this rank. Build with `tp.init_mesh`."""

    def __init__(self, *, tp: int, pp: int, dp: int | None, order: str, owns_default_group: bool,
                 cp: int = 1, ep: int = 1, etp: int | None = None) -> None:
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.sizes = dense_sizes(self.world_size, tp, pp, dp, cp)
        self.order = parse_order(order, self.sizes)
        self._owns_default_group, self._destroyed = owns_default_group, False
        table = layout(self.world_size, tp=tp, cp=cp, pp=pp, dp=self.sizes["dp"], ep=ep, etp=etp, order=order)
        self.expert_sizes = expert_sizes(self.world_size, self.sizes, ep, etp)  # {etp, ep, edp, pp}
        self.expert_order = expert_order(order, self.expert_sizes)
        table["embedding"] = [_embedding_ranks(g) for g in table["pp"]]
        if _kept_groups[0] is not dist.group.WORLD:
            _kept_groups[:] = [dist.group.WORLD, {}]
        kept = _kept_groups[1]
        timeout = default_group_timeout()  # new_group's own default is torch's (30 min on gloo), not the world's
        if _destroyed_groups[0]:  # (creating groups is collective anyway: this barrier adds no new wait)
            dist.barrier()
            _destroyed_groups[0] = False
        self._ranks, self._groups, created = {}, {}, {}
        # new_group is collective over the world: every rank creates every group, in the same order (and every
        # rank has kept the same groups, since all of them ran the same init/destroy calls).
        for name, groups in table.items():
            for ranks in groups:
                key = tuple(ranks)
                if key not in created:
                    if len(ranks) == self.world_size:
                        created[key] = dist.group.WORLD
                    elif key in kept:
                        created[key] = kept.pop(key)
                    else:
                        created[key] = dist.new_group(list(ranks), timeout=timeout)
                if self.rank in ranks:
                    self._ranks[name], self._groups[name] = list(ranks), created[key]
        self._created = {k: g for k, g in created.items() if g is not dist.group.WORLD}
        self._device_mesh = None

    def _check(self, axis):
        if self._destroyed:
            raise RuntimeError("this mesh was destroyed by tp.destroy_mesh(); use the current one (tp.get_mesh())")
        if axis not in self._ranks:
            raise ValueError(f"unknown axis {axis!r}; expected one of {sorted(self._ranks)}")
        return axis

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along `axis` ("tp", "cp", "dp", "pp", "tp-pp", "tp-dp", "tp-cp", "dp-cp",
        "tp-cp-dp", "embedding"; the experts' "ep", "etp", "edp", "etp-ep")."""
        return self._groups[self._check(axis)]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`."""
        return list(self._ranks[self._check(axis)])

    def size(self, axis: str) -> int:
        """The number of ranks of this rank's group along `axis`."""
        return len(self._ranks[self._check(axis)])

    def local_rank(self, axis: str) -> int:
        """This rank's index within its group along `axis`."""
        return self._ranks[self._check(axis)].index(self.rank)

    # The axes users touch most often.
    tp_group = property(lambda self: self.group("tp"))
    cp_group = property(lambda self: self.group("cp"))
    dp_group = property(lambda self: self.group("dp"))
    pp_group = property(lambda self: self.group("pp"))
    tp_size = property(lambda self: self.sizes["tp"])
    cp_size = property(lambda self: self.sizes["cp"])
    dp_size = property(lambda self: self.sizes["dp"])
    pp_size = property(lambda self: self.sizes["pp"])
    tp_rank = property(lambda self: self.local_rank("tp"))
    cp_rank = property(lambda self: self.local_rank("cp"))
    dp_rank = property(lambda self: self.local_rank("dp"))
    pp_rank = property(lambda self: self.local_rank("pp"))
    # The expert layout: expert-parallel, expert-tensor-parallel and expert-data-parallel groups.
    ep_group = property(lambda self: self.group("ep"))
    etp_group = property(lambda self: self.group("etp"))
    edp_group = property(lambda self: self.group("edp"))
    ep_size = property(lambda self: self.expert_sizes["ep"])
    etp_size = property(lambda self: self.expert_sizes["etp"])
    edp_size = property(lambda self: self.expert_sizes["edp"])
    ep_rank = property(lambda self: self.local_rank("ep"))
    etp_rank = property(lambda self: self.local_rank("etp"))
    edp_rank = property(lambda self: self.local_rank("edp"))

    # Pipeline helpers: neighbours wrap around modulo the pipeline size.
    is_first_stage = property(lambda self: self.pp_rank == 0)
    is_last_stage = property(lambda self: self.pp_rank == self.pp_size - 1)
    next_stage_rank = property(lambda self: self._ranks["pp"][(self.pp_rank + 1) % self.pp_size])
    prev_stage_rank = property(lambda self: self._ranks["pp"][(self.pp_rank - 1) % self.pp_size])
    embedding_group = property(lambda self: self.group("embedding"))
    embedding_ranks = property(lambda self: self.ranks("embedding"))
    in_embedding_group = property(lambda self: self.is_first_stage or self.is_last_stage)

    @property
    def device_mesh(self) -> DeviceMesh:
        """A torch DeviceMesh on this mesh's groups, dims slowest first (reversed `order`: ("pp", "dp", "cp", "tp") by
        default). `flat_device_mesh("dp-cp")` is the one-dimensional mesh of a composite group (FSDP2 over dp×cp)."""
        if self._device_mesh is None:
            names = tuple(reversed(self.order))  # DeviceMesh is row-major: last dim fastest
            mesh = torch.arange(self.world_size, device="cpu").reshape([self.sizes[a] for a in names])
            self._device_mesh = DeviceMesh.from_group(
                [self.group(a) for a in names], collective_device().type, mesh=mesh, mesh_dim_names=names
            )
        return self._device_mesh

    def flat_device_mesh(self, axis: str, device_type: str | None = None) -> DeviceMesh:
        """A one-dimensional torch DeviceMesh over this rank's group along `axis` (an axis or a composite such as
        "dp-cp"), its dim named `axis` with "_" for "-"; on `device_type` (default: the collectives' device), e.g.
        "cpu" for CPU tensors under a cpu:gloo,cuda:nccl group (a DTensor on a CUDA mesh would copy them to the GPU)."""
        return DeviceMesh.from_group(self.group(axis), device_type or collective_device().type,
                                     mesh=torch.tensor(self.ranks(axis), device="cpu"),
                                     mesh_dim_names=(axis.replace("-", "_"),))

    def __repr__(self) -> str:
        coords = ", ".join(f"{a}={self.local_rank(a)}/{self.sizes[a]}" for a in self.order)
        if self.ep_size > 1 or self.etp_size != self.tp_size:  # the expert coordinates, where they differ
            coords += "".join(f", {a}={self.local_rank(a)}/{self.expert_sizes[a]}" for a in EXPERT_AXES)
        return f"Mesh(rank={self.rank}/{self.world_size}, order={'-'.join(self.order)!r}, {coords})"

    def destroy(self, keep_groups: bool = False) -> None:
        """Destroy (or, `keep_groups`, keep for the next mesh) this mesh's groups; tp.destroy_mesh calls it."""
        if keep_groups and not self._owns_default_group:
            _kept_groups[1].update(self._created)
        else:
            tearing_down = bool(self._created) and not self._owns_default_group
            if tearing_down:  # no rank still connecting or using them (a collective call: every rank destroys)
                dist.barrier()
            for group in self._created.values():
                dist.destroy_process_group(group)
            _destroyed_groups[0] = tearing_down
        self._created, self._groups, self._destroyed = {}, {}, True
        _forget_dtensor_sharding()
        if self._owns_default_group:
            dist.destroy_process_group()


def _forget_dtensor_sharding():
    """Empty DTensor's cache of sharding decisions: it matches meshes by ranks and dim names, so a later mesh of the
    same shape would get output DTensors on this mesh's device meshes, whose groups are gone ("Could not resolve the
    process group"), e.g. FSDP2 gradients accumulated after a re-initialisation in one process."""
    if "torch.distributed.tensor" in sys.modules:
        propagator = sys.modules["torch.distributed.tensor"].DTensor._op_dispatcher.sharding_propagator
        getattr(propagator.propagate_op_sharding, "cache_clear", lambda: None)()  # the Python cache
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()  # and its C++ fast path


def init_mesh(*, tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None, ep: int = 1, etp: int | None = None,
              order: str = DEFAULT_ORDER, backend: str | None = None,
              timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> Mesh:
    """Create every group of the layout once and make the mesh current (used by layers when no group is passed).
    `ep` and `etp` (default: tp) lay out the experts of mixture-of-experts layers over the same ranks.

    Uses the default process group if one exists (then `backend` and `timeout` are those it was created with),
    else initialises it from torchrun's environment (gloo on CPU; with CUDA "cpu:gloo,cuda:nccl", NCCL for CUDA tensors
    and gloo for CPU ones, unless `backend` says otherwise), or from SLURM's in a task of `srun` (tp/slurm.py);
    a lone process gets a one-rank group.
    """
    global _current
    if _current is not None:
        raise RuntimeError(f"a mesh is already initialised ({_current!r}); call tp.destroy_mesh() first")
    parse_order(order)
    if not dist.is_initialized():
        use_srun_environment()  # srun's tasks: torchrun's variables from SLURM's
    if not dist.is_initialized() and not launched_by_torchrun():  # one process: a mesh of several ranks cannot be made
        try:
            needed = tp * cp * pp * (dp or 1)
        except TypeError:
            needed = 1  # (the size check names the bad value)
        if needed > 1:
            dense_sizes(needed, tp, pp, dp, cp)
            raise lone_process_error(tp, cp, pp, dp)
    if not dist.is_initialized() and launched_by_torchrun():
        # kept when the mesh is destroyed: re-creating it from the same environment can hang inside torch (Megatron
        # keeps it too)
        init_default_group(backend, timeout)
    owns = not dist.is_initialized()  # a lone process: its one-rank group is made here and destroyed with the mesh
    if not owns:  # validate before any collective so that every rank raises the same error
        layout(dist.get_world_size(), tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)
    else:
        init_default_group(backend, timeout)
    try:
        _current = Mesh(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order, owns_default_group=owns)
    except Exception:
        if owns:
            dist.destroy_process_group()
        raise
    return _current


def get_mesh() -> Mesh:
    """The current mesh; raises if `tp.init_mesh` has not been called."""
    if _current is None:
        raise RuntimeError("no tensor-parallel mesh: call tp.init_mesh(...) first, or pass group= explicitly")
    return _current


def destroy_mesh(*, keep_groups: bool = False) -> None:
    """Destroy the current mesh's groups (and the default group if init_mesh created it for a lone process; one made
    from torchrun's environment is kept for the next init_mesh: `torch.distributed.destroy_process_group()` at exit).
    Collective, as init_mesh: every rank calls it (it synchronises the ranks before tearing the groups down).

    keep_groups=True keeps the process groups for a later init_mesh that needs the same rank lists (creating
    groups is the slow part; the test harness reuses them across tests, as a training job would keep them).
    """
    global _current
    if _current is not None:
        _current.destroy(keep_groups=keep_groups)
        _current = None


def current_mesh() -> Mesh | None:
    """The current mesh, or None before `tp.init_mesh` (get_mesh raises instead)."""
    return _current


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """`group` itself (this rank must be one of its members), or the current mesh's tensor-parallel group when None."""
    if group is None:
        return get_mesh().tp_group
    if not torch.compiler.is_compiling() and dist.get_rank(group) < 0:  # (a rank outside the group: -1)
        raise ValueError(f"rank {dist.get_rank()} is not a member of the process group it was given (build the layer "
                         "on the group's ranks, or pass a group holding this rank)")
    return group


def resolve_cp_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """`group` itself, else the current mesh's context-parallel group, else None (no mesh: no context parallelism)."""
    if group is not None:
        return group
    return _current.cp_group if _current is not None else None


class SharedGroup:
    """A class attribute holding a process group (or None) that `copy.deepcopy` of its instance shares instead of
    copying: a group is a handle to a communicator, so a deep copy of a module (an EMA or reference model) talks
    over the same groups. `class Layer(nn.Module): group = SharedGroup()`, then `self.group = ...` as usual."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        # The handle's key differs from the attribute's: Dynamo (torch 2.11) reads `instance.__dict__[key]` as
        # `instance.key`, which under the attribute's own name would call this descriptor again, without end.
        self.key = f"_shared_{name}"

    def __get__(self, instance: object, owner: type | None = None) -> "dist.ProcessGroup | None | SharedGroup":
        if instance is None:  # (on the class: the descriptor itself)
            return self
        try:
            return instance.__dict__[self.key].group
        except KeyError:
            raise AttributeError(f"{type(instance).__name__!r} object has no attribute {self.name!r}") from None

    def __set__(self, instance: object, group: dist.ProcessGroup | None) -> None:
        instance.__dict__[self.key] = _GroupHandle(group)


class _GroupHandle:
    """An instance's value of a SharedGroup attribute: deep copies keep this very object, hence the group."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self
