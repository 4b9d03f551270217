"""The hybrid mesh: ranks grouped into tensor (tp), context (cp), data (dp) and pipeline (pp) groups in Megatron's
rank order, and the same ranks grouped again for the experts of mixture-of-experts layers.

`order` lists the axes fastest-varying first ("tp-cp-dp-pp" is Megatron's default, its "tp-cp-ep-dp-pp" without
experts): with strides the prefix products of the sizes in that order, rank = Σ coord[axis]·stride[axis].
Tensor-parallel groups are thus adjacent ranks (one node's NVLink domain) under the default order. An axis of size 1
may be left out of `order` (it is appended, as Megatron's RankGenerator does): "tp-dp-pp" is the same layout as
"tp-cp-dp-pp" when cp = 1.

Experts (Megatron-Core's second RankGenerator over the same ranks): expert-tensor-parallel `etp` in the place of tp,
expert-parallel `ep`, expert-data-parallel `edp` = world / (etp·ep·pp) in the place of dp, pp, and no cp, in the same
order string. "ep" may be named in `order`; left out, it sits just before "dp" (Megatron's tp-cp-ep-dp-pp). The
dense layout ignores ep, the expert layout ignores cp; both must give the same pipeline groups.
"""
import datetime
import itertools
import numbers
import os
import shlex
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

AXES = ("tp", "cp", "dp", "pp")
# "tp-pp": model-parallel (a parameter's shards); "dp-cp": the group gradients are reduced over; "tp-cp": the ranks
# that share one micro-batch (the loss is equal on all of them); "tp-cp-dp": one pipeline stage's ranks, which hold
# the tokens of all the data-parallel micro-batches of a step (a mixture of experts' load statistics cover them)
COMPOSITES = ("tp-pp", "tp-dp", "tp-cp", "dp-cp", "tp-cp-dp")
# The expert layout's axes (Megatron-Core's expert RankGenerator: its "tp", "ep", "dp" are etp, ep, edp) and groups
EXPERT_AXES = ("etp", "ep", "edp")
EXPERT_GROUPS = ("ep", "etp", "edp", "etp-ep")
_EXPERT_NAMES = {"tp": "etp", "dp": "edp", "ep": "ep", "pp": "pp"}  # order token -> expert axis

_current = None
# Process groups kept by destroy_mesh(keep_groups=True) for the next init_mesh, keyed by their ranks, valid while
# the default group they were made under (the first entry) lives.
_kept_groups = [None, {}]


def _parse_order(order, sizes=None):
    """The dense axes of `order`, fastest first (an "ep" in it dropped: the dense layout has no ep), with the axes it
    leaves out appended (each must have size 1 in `sizes`)."""
    tokens = order.split("-") if isinstance(order, str) else []
    repeated = sorted({a for a in tokens if tokens.count(a) > 1})
    axes = [a for a in tokens if a != "ep"]
    unknown = [a for a in axes if a not in AXES]
    missing = [a for a in AXES if a not in axes and (sizes is None or sizes[a] > 1)]
    if unknown or repeated or not axes or (sizes is not None and missing):
        raise ValueError(
            f"order={order!r} must list each of {'/'.join(AXES)}/ep at most once, and every axis of size > 1 "
            f"(unknown: {unknown}, missing: {missing}, repeated: {repeated})"
        )
    return axes + [a for a in AXES if a not in axes]


def _integer(name, value):
    """value as an int, refused unless an integer (any integer type, numpy's too, not bool) >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


def _sizes(world_size, tp, pp, dp, cp=1):
    world_size, tp, cp, pp = (_integer(n, v) for n, v in (("world_size", world_size), ("tp", tp), ("cp", cp),
                                                          ("pp", pp)))
    dp = None if dp is None else _integer("dp", dp)
    # the messages name cp only when it is used, so a tp/pp/dp user reads the formula they know
    names, values = ("tp*cp*pp", f"{tp}*{cp}*{pp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
    if world_size % (tp * cp * pp):
        raise ValueError(f"world_size={world_size} is not divisible by {names}={values}={tp * cp * pp}")
    if dp is None:
        dp = world_size // (tp * cp * pp)
    if tp * cp * dp * pp != world_size:
        names, values = ("tp*cp*dp*pp", f"{tp}*{cp}*{dp}*{pp}") if cp > 1 else ("tp*dp*pp", f"{tp}*{dp}*{pp}")
        raise ValueError(f"{names}={values}={tp * cp * dp * pp} does not equal world_size={world_size}")
    return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}


def _expert_sizes(world_size, sizes, ep, etp):
    """{etp, ep, edp, pp} of the expert layout: etp defaults to tp, edp = world / (etp·ep·pp)."""
    ep = _integer("ep", ep)
    etp = sizes["tp"] if etp is None else _integer("etp", etp)
    pp = sizes["pp"]
    if world_size % (etp * ep * pp):
        raise ValueError(f"world_size={world_size} is not divisible by etp*ep*pp={etp}*{ep}*{pp}={etp * ep * pp} "
                         "(the expert layout)")
    return {"etp": etp, "ep": ep, "edp": world_size // (etp * ep * pp), "pp": pp}


def _expert_order(order, esizes):
    """The expert layout's axes, fastest first: `order` with tp read as etp, dp as edp, cp dropped and ep where it
    is named (else just before dp); axes left out appended (each of size 1)."""
    tokens = order.split("-")
    if "ep" not in tokens:
        tokens.insert(tokens.index("dp") if "dp" in tokens else len(tokens), "ep")
    axes = [_EXPERT_NAMES[t] for t in tokens if t != "cp"]
    missing = [a for a in ("etp", "ep", "edp", "pp") if a not in axes]
    unnamed = [a for a in missing if esizes[a] > 1]
    if unnamed:
        token = {"etp": "tp", "edp": "dp"}
        raise ValueError(f"order={order!r} must name {'/'.join(token.get(a, a) for a in unnamed)}: the expert layout "
                         f"has {', '.join(f'{a}={esizes[a]}' for a in unnamed)}")
    return axes + missing


def _groups(sizes, order, axes):
    """Rank groups varying `axes` (others fixed), members listed with the axes in order-string order."""
    axes = [a for a in order if a in axes]
    strides = dict(zip(order, itertools.accumulate([1] + [sizes[a] for a in order[:-1]], lambda s, n: s * n)))
    others = [a for a in order if a not in axes]
    groups = []
    for fixed in itertools.product(*(range(sizes[a]) for a in others)):
        base = sum(c * strides[a] for a, c in zip(others, fixed))
        # itertools.product varies its last argument fastest, so feed the axes slowest first.
        members = [
            base + sum(c * strides[a] for a, c in zip(reversed(axes), coords))
            for coords in itertools.product(*(range(sizes[a]) for a in reversed(axes)))
        ]
        groups.append(members)
    return sorted(groups)


DEFAULT_ORDER = "tp-cp-dp-pp"


def layout(world_size: int, *, tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None, ep: int = 1,
           etp: int | None = None, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """Rank groups per axis ("tp", "cp", "dp", "pp") and composite ("tp-pp" model-parallel, "tp-dp", "tp-cp",
    "dp-cp", "tp-cp-dp" one stage), each as megatron-core's RankGenerator lists them, and the expert layout's "ep",
    "etp", "edp" and "etp-ep" (its RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1)'s "ep", "tp", "dp" and
    "tp-ep"; with ep = 1 and etp = tp simply the singletons, "tp", "dp-cp" and "tp"); no process group needed."""
    sizes = _sizes(world_size, tp, pp, dp, cp)
    axes = _parse_order(order, sizes)
    table = {name: _groups(sizes, axes, name.split("-")) for name in AXES + COMPOSITES}
    esizes = _expert_sizes(world_size, sizes, ep, etp)
    if esizes["ep"] == 1 and esizes["etp"] == sizes["tp"]:  # experts not split: the dense groups, whatever the order
        return table | {"ep": [[r] for r in range(world_size)], "etp": table["tp"], "edp": table["dp-cp"],
                        "etp-ep": table["tp"]}
    eaxes = _expert_order(order, esizes)
    expert = {name: _groups(esizes, eaxes, name.split("-")) for name in EXPERT_GROUPS + ("pp",)}
    if expert["pp"] != table["pp"]:
        raise ValueError(f"etp={esizes['etp']}, ep={esizes['ep']} with order={order!r}: the expert layout's pipeline "
                         f"groups ({expert['pp'][0]}, ...) differ from the dense layout's ({table['pp'][0]}, ...); "
                         "put pp last in the order (the default), or use etp = tp")
    return table | {name: expert[name] for name in EXPERT_GROUPS}


def _embedding_ranks(pp_ranks):
    return sorted({pp_ranks[0], pp_ranks[-1]})


class Mesh:
    """Process groups of one hybrid layout, seen from this rank. Build with `tp.init_mesh`."""

    def __init__(self, *, tp: int, pp: int, dp: int | None, order: str, owns_default_group: bool,
                 cp: int = 1, ep: int = 1, etp: int | None = None) -> None:
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.sizes = _sizes(self.world_size, tp, pp, dp, cp)
        self.order = _parse_order(order, self.sizes)
        self._owns_default_group, self._destroyed = owns_default_group, False
        table = layout(self.world_size, tp=tp, cp=cp, pp=pp, dp=self.sizes["dp"], ep=ep, etp=etp, order=order)
        self.expert_sizes = _expert_sizes(self.world_size, self.sizes, ep, etp)  # {etp, ep, edp, pp}
        self.expert_order = _expert_order(order, self.expert_sizes)
        table["embedding"] = [_embedding_ranks(g) for g in table["pp"]]
        if _kept_groups[0] is not dist.group.WORLD:
            _kept_groups[:] = [dist.group.WORLD, {}]
        kept = _kept_groups[1]
        timeout = _default_group_timeout()  # new_group's own default is torch's (30 min on gloo), not the world's
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
            mesh = torch.arange(self.world_size).reshape([self.sizes[a] for a in names])
            self._device_mesh = DeviceMesh.from_group(
                [self.group(a) for a in names], collective_device().type, mesh=mesh, mesh_dim_names=names
            )
        return self._device_mesh

    def flat_device_mesh(self, axis: str, device_type: str | None = None) -> DeviceMesh:
        """A one-dimensional torch DeviceMesh over this rank's group along `axis` (an axis or a composite such as
        "dp-cp"), its dim named `axis` with "_" for "-"; on `device_type` (default: the collectives' device), e.g.
        "cpu" for CPU tensors under a cpu:gloo,cuda:nccl group (a DTensor on a CUDA mesh would copy them to the GPU)."""
        return DeviceMesh.from_group(self.group(axis), device_type or collective_device().type,
                                     mesh=torch.tensor(self.ranks(axis)), mesh_dim_names=(axis.replace("-", "_"),))

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
            for group in self._created.values():
                dist.destroy_process_group(group)
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


def launched_by_torchrun() -> bool:
    """Whether torchrun (or a launcher that sets its RANK and WORLD_SIZE) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """The default group's backend when none is given: with CUDA, NCCL for CUDA tensors and gloo for CPU tensors in
    the same group (so CPU tensors, such as a loader's indices or an optimizer's scalars, still reduce), else gloo."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: this rank's GPU under NCCL, else the CPU (also
    before any process group exists)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_group_timeout():
    """The default group's collective timeout (None where torch does not expose it: new_group's default then)."""
    try:
        return dist.group.WORLD._get_backend(collective_device()).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _lone_process_error(tp, cp, pp, dp):
    """The error of a mesh that needs several processes asked for in one process started without torchrun."""
    world = tp * cp * pp * (dp or 1)
    given = {k: v for k, v in dict(tp=tp, cp=cp, pp=pp, dp=dp).items() if v not in (1, None)}
    call = ", ".join(f"{k}={v}" for k, v in given.items())
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        target = ["-m", spec.name.removesuffix(".__main__")]
    elif sys.argv and sys.argv[0] and sys.argv[0] != "-c":
        target = [sys.argv[0]]
    else:
        target = ["your_script.py"]
    command = shlex.join(["torchrun", "--nproc-per-node", str(world), *target, *sys.argv[1:]])
    return RuntimeError(f"tp.init_mesh({call}) needs {world} processes, but this is one process started without "
                        f"torchrun (RANK and WORLD_SIZE are not set): launch it with `{command}`, or use "
                        + ", ".join(f"{k}=1" for k in given) + " in one process")


def _init_default_group(backend, timeout):
    backend = backend or default_backend()
    if launched_by_torchrun():
        if "nccl" in backend:  # one rank per GPU: this rank's (NCCL refuses two ranks on one device)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # torchrun's agent keeps one TCPStore across restarts of the worker group (--max-restarts): keys under a
        # per-attempt prefix, or a restarted rank can read the previous attempt's addresses (pytorch#135712)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:  # a single process outside any launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def init_mesh(*, tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None, ep: int = 1, etp: int | None = None,
              order: str = DEFAULT_ORDER, backend: str | None = None,
              timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> Mesh:
    """Create every group of the layout once and make the mesh current (used by layers when no group is passed).
    `ep` and `etp` (default: tp) lay out the experts of mixture-of-experts layers over the same ranks.

    Uses the default process group if one exists (then `backend` and `timeout` are those it was created with),
    else initialises it from torchrun's environment (gloo on CPU; with CUDA "cpu:gloo,cuda:nccl", NCCL for CUDA tensors
    and gloo for CPU ones, unless `backend` says otherwise);
    a lone process gets a one-rank group.
    """
    global _current
    if _current is not None:
        raise RuntimeError(f"a mesh is already initialised ({_current!r}); call tp.destroy_mesh() first")
    _parse_order(order)
    if not dist.is_initialized() and not launched_by_torchrun():  # one process: a mesh of several ranks cannot be made
        try:
            needed = tp * cp * pp * (dp or 1)
        except TypeError:
            needed = 1  # (the size check names the bad value)
        if needed > 1:
            _sizes(needed, tp, pp, dp, cp)
            raise _lone_process_error(tp, cp, pp, dp)
    if not dist.is_initialized() and launched_by_torchrun():
        # kept when the mesh is destroyed: re-creating it from the same environment can hang inside torch (Megatron
        # keeps it too)
        _init_default_group(backend, timeout)
    owns = not dist.is_initialized()  # a lone process: its one-rank group is made here and destroyed with the mesh
    if not owns:  # validate before any collective so that every rank raises the same error
        layout(dist.get_world_size(), tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)
    else:
        _init_default_group(backend, timeout)
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
    """`group` itself, or the current mesh's tensor-parallel group when None."""
    return get_mesh().tp_group if group is None else group


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
        # (the instance keeps it under another key: Dynamo in torch 2.11 reads instance.__dict__[name] as
        # getattr(instance, name), which is this descriptor again, and recursed without end)
        self.name, self.key = name, f"_shared_{name}"

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
