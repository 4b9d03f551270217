"""tp.layout (pure) and tp.init_mesh (real process groups): hand-checked examples, invariants, errors."""
import itertools
import os

import pytest
import torch
import torch.distributed as dist

import tp
from tp.testing import distributed

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]
ORDERS_CP = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp"))]


def test_layout_reference_example():
    """REFERENCE.md: 16 ranks, TP=2, PP=4 (DP=2), Megatron's default order."""
    groups = tp.layout(16, tp=2, pp=4)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups["tp-pp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert groups["tp-dp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_layout_other_orders_by_hand():
    # dp fastest: data-parallel replicas are adjacent, tp groups strided by DP.
    groups = tp.layout(8, tp=2, pp=2, order="dp-tp-pp")
    assert groups["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # pp fastest, then tp: rank = pp + 2*(tp + 2*dp)
    groups = tp.layout(8, tp=2, pp=2, order="pp-tp-dp")
    assert groups["pp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["tp-pp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _coords(rank, sizes, order):
    coords = {}
    for axis in order.split("-"):
        rank, coords[axis] = divmod(rank, sizes[axis])
    return coords


@pytest.mark.parametrize("order", ORDERS_CP)
@pytest.mark.parametrize("world_size", [1, 2, 4, 6, 8, 12, 16, 24])
def test_layout_invariants(world_size, order):
    for tp_size, cp_size, pp_size in itertools.product(range(1, world_size + 1), repeat=3):
        if world_size % (tp_size * cp_size * pp_size):
            continue
        sizes = {"tp": tp_size, "cp": cp_size, "pp": pp_size, "dp": world_size // (tp_size * cp_size * pp_size)}
        groups = tp.layout(world_size, tp=tp_size, cp=cp_size, pp=pp_size, order=order)
        assert groups == tp.layout(world_size, tp=tp_size, cp=cp_size, pp=pp_size, dp=sizes["dp"], order=order)
        for name in tp.mesh.EXPERT_GROUPS:  # (test_expert_layout_* check the expert part)
            del groups[name]
        for name, gs in groups.items():
            axes = name.split("-")
            size = 1
            for a in axes:
                size *= sizes[a]
            assert all(len(g) == size for g in gs), name  # right sizes
            assert sorted(r for g in gs for r in g) == list(range(world_size)), name  # a partition of the world
            for g in gs:  # members agree on every other axis and differ on the named ones
                cs = [_coords(r, sizes, order) for r in g]
                assert all(c[a] == cs[0][a] for c in cs for a in sizes if a not in axes), (name, g)
                assert len({tuple(c[a] for a in axes) for c in cs}) == len(g)
        if order.startswith("tp-"):  # Megatron's default: tp groups are blocks of adjacent ranks
            assert all(g == list(range(g[0], g[0] + tp_size)) for g in groups["tp"])


def _megatron_rank_groups(world_size, sizes, order, token):
    """megatron-core's RankGenerator.get_ranks(token) (generate_masked_orthogonal_rank_groups), transcribed: groups
    enumerated over the other axes (first in `order` fastest), members over the token's axes (first fastest)."""
    axes = order.split("-")
    axes += [a for a in sizes if a not in axes]  # axes of size 1 left out of the order are appended
    strides = list(itertools.accumulate([1] + [sizes[a] for a in axes[:-1]], lambda a, b: a * b))
    masked = [(sizes[a], st) for a, st in zip(axes, strides) if a in token.split("-")]
    unmasked = [(sizes[a], st) for a, st in zip(axes, strides) if a not in token.split("-")]

    def offsets(dims):  # every coordinate combination, the first dim fastest, as Σ coord·stride
        out = [0]
        for size, stride in dims:
            out = [o + c * stride for c in range(size) for o in out]
        return out

    return [[base + member for member in offsets(masked)] for base in offsets(unmasked)]


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-cp-pp-dp", "tp-dp-cp-pp", "cp-tp-dp-pp", "pp-dp-cp-tp",
                                   "tp-dp-pp"])
def test_layout_equals_megatron_rank_generator(order):
    """Every group list, for every split of 1..16 ranks, as megatron-core's RankGenerator lists it (the real one
    when megatron-core is installed, else its algorithm transcribed)."""
    try:
        from megatron.core.parallel_state import RankGenerator
    except ImportError:
        RankGenerator = None
    checked = 0
    for world_size in (1, 2, 4, 8, 12, 16):
        for tp_size, cp_size, pp_size in itertools.product((1, 2, 3, 4), repeat=3):
            if world_size % (tp_size * cp_size * pp_size) or (cp_size > 1 and "cp" not in order):
                continue
            dp_size = world_size // (tp_size * cp_size * pp_size)
            sizes = {"tp": tp_size, "cp": cp_size, "dp": dp_size, "pp": pp_size}
            groups = tp.layout(world_size, tp=tp_size, cp=cp_size, pp=pp_size, order=order)
            for token in ("tp", "cp", "dp", "pp", "tp-pp", "tp-dp", "tp-cp", "dp-cp"):
                expected = (RankGenerator(tp=tp_size, ep=1, dp=dp_size, pp=pp_size, cp=cp_size, order=order)
                            .get_ranks(token) if RankGenerator else
                            _megatron_rank_groups(world_size, sizes, order, token))
                assert groups[token] == expected, (world_size, sizes, order, token)
                checked += 1
    assert checked > 100


def test_layout_with_cp_by_hand():
    """16 ranks, tp=2 cp=2 pp=2 (dp=2), Megatron's order tp-cp-dp-pp: rank = tp + 2·cp + 4·dp + 8·pp."""
    groups = tp.layout(16, tp=2, cp=2, pp=2)
    assert groups["tp"][:2] == [[0, 1], [2, 3]]
    assert groups["cp"][:3] == [[0, 2], [1, 3], [4, 6]]
    assert groups["dp"][:3] == [[0, 4], [1, 5], [2, 6]]
    assert groups["pp"][:2] == [[0, 8], [1, 9]]
    assert groups["tp-cp"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["dp-cp"][:3] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14]]
    # cp = 1: the layouts of the three-axis orders are unchanged
    assert tp.layout(8, tp=2, pp=2, order="tp-dp-pp") == tp.layout(8, tp=2, pp=2)
    assert tp.layout(8, tp=2, pp=2)["cp"] == [[r] for r in range(8)]


def test_expert_layout_by_hand():
    """8 ranks, tp=2 (dp=4), ep=2, Megatron's order tp-cp-ep-dp-pp: the experts' etp = tp fastest, ep next, then edp:
    expert rank = etp + 2·ep + 4·edp."""
    groups = tp.layout(8, tp=2, ep=2)
    assert groups["etp"] == groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # ep ranks are dp ranks of the dense part
    assert groups["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["etp-ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["tp-cp-dp"] == [list(range(8))]  # one stage: the ranks holding a step's tokens
    # etp = 1, ep = 4: each group of four dense ranks (a tp pair, two dp replicas) holds all the experts once
    groups = tp.layout(8, tp=2, ep=4, etp=1)
    assert groups["etp"] == [[r] for r in range(8)] and groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # naming ep elsewhere in the order moves it; leaving it out is Megatron's default place (before dp)
    assert tp.layout(8, tp=2, ep=2, order="ep-tp-cp-dp-pp")["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tp.layout(8, tp=2, ep=2, order="tp-cp-dp-ep-pp")["ep"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp.layout(8, tp=2, ep=2) == tp.layout(8, tp=2, ep=2, order="tp-cp-ep-dp-pp")


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-dp-pp", "tp-ep-cp-dp-pp", "tp-cp-dp-ep-pp",
                                   "ep-tp-cp-dp-pp", "tp-cp-ep-pp-dp", "pp-tp-cp-ep-dp"])
def test_expert_layout_equals_megatron_rank_generator(order):
    """The expert groups of every split of 1..16 ranks (tp, cp, pp, ep, etp up to 4), as megatron-core's expert
    RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1) lists them for "ep", "tp", "dp", "tp-ep" (an order without ep:
    Megatron's tp-cp-ep-dp-pp place, before dp); layouts whose two pipeline groupings differ are refused."""
    megatron_order = order if "ep" in order else order.replace("dp", "ep-dp")
    checked = refused = 0
    for world_size in range(1, 17):
        for tp_size, cp_size, pp_size, ep, etp in itertools.product((1, 2, 3, 4), (1, 2), (1, 2), (1, 2, 3, 4),
                                                                    (None, 1, 2)):
            etp_size = etp or tp_size
            if world_size % (tp_size * cp_size * pp_size) or world_size % (etp_size * ep * pp_size):
                continue
            edp = world_size // (etp_size * ep * pp_size)
            expert = {"tp": etp_size, "cp": 1, "ep": ep, "dp": edp, "pp": pp_size}
            dense = {"tp": tp_size, "cp": cp_size, "ep": 1, "dp": world_size // (tp_size * cp_size * pp_size),
                     "pp": pp_size}
            same_pp = (_megatron_rank_groups(world_size, expert, megatron_order, "pp")
                       == _megatron_rank_groups(world_size, dense, megatron_order, "pp"))
            kwargs = dict(tp=tp_size, cp=cp_size, pp=pp_size, ep=ep, etp=etp, order=order)
            if ep == 1 and etp_size == tp_size:  # no expert split: the dense groups, even where Megatron refuses
                groups = tp.layout(world_size, **kwargs)
                assert groups["edp"] == groups["dp-cp"] and groups["etp"] == groups["etp-ep"] == groups["tp"]
                assert groups["ep"] == [[r] for r in range(world_size)]
                if not same_pp:
                    continue
            elif not same_pp:
                with pytest.raises(ValueError, match="pipeline groups"):
                    tp.layout(world_size, **kwargs)
                refused += 1
                continue
            groups = tp.layout(world_size, **kwargs)
            for ours, token in (("ep", "ep"), ("etp", "tp"), ("edp", "dp"), ("etp-ep", "tp-ep")):
                expected = _megatron_rank_groups(world_size, expert, megatron_order, token)
                assert groups[ours] == sorted(expected), (world_size, kwargs, ours)
                checked += 1
            ranks = sorted(r for g in groups["tp-cp-dp"] for r in g)
            assert ranks == list(range(world_size)) and len(groups["tp-cp-dp"]) == pp_size
    assert checked > 400 and (refused > 0) == ("pp" not in (order.split("-")[0], order.split("-")[-1]))


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=8, tp=2, ep=3), r"world_size=8 is not divisible by etp\*ep\*pp=2\*3\*1=6"),
    (dict(world_size=8, tp=2, ep=2, etp=3), r"world_size=8 is not divisible by etp\*ep\*pp=3\*2\*1=6"),
    (dict(world_size=8, ep=0), r"ep=0 must be an integer >= 1"),
    (dict(world_size=8, ep=2, etp=True), r"etp=True must be an integer >= 1"),
    (dict(world_size=8, tp=2, pp=2, etp=1, order="tp-pp-dp"), r"etp=1, ep=1 with order='tp-pp-dp': the expert "
     r"layout's pipeline groups \(\[0, 1\], ...\) differ from the dense layout's \(\[0, 2\], ...\)"),
    (dict(world_size=4, tp=2, ep=2, order="tp-ep-ep-dp-pp"), r"repeated: \['ep'\]"),
])
def test_expert_layout_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tp.layout(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=8, tp=3), r"world_size=8 is not divisible by tp\*pp=3\*1=3"),
    (dict(world_size=8, tp=2, cp=3), r"world_size=8 is not divisible by tp\*cp\*pp=2\*3\*1=6"),
    (dict(world_size=8, tp=2, cp=2, dp=3), r"tp\*cp\*dp\*pp=2\*2\*3\*1=12 does not equal world_size=8"),
    (dict(world_size=8, cp=0), r"cp=0 must be an integer >= 1"),
    (dict(world_size=8, cp=2, order="tp-dp-pp"), r"order='tp-dp-pp' .*missing: \['cp'\]"),
    (dict(world_size=8, tp=2, pp=2, dp=3), r"tp\*dp\*pp=2\*3\*2=12 does not equal world_size=8"),
    (dict(world_size=8, tp=0), r"tp=0 must be an integer >= 1"),
    (dict(world_size=8, pp=-2), r"pp=-2 must be an integer >= 1"),
    (dict(world_size=8, tp=True), r"tp=True must be an integer >= 1"),  # bools are ints to Python, not to us
    (dict(world_size=8, tp=2.0), r"tp=2.0 must be an integer >= 1"),
    (dict(world_size=8, tp=2, dp=False), r"dp=False must be an integer >= 1"),
    (dict(world_size=4, order="tp-dp-xp"), r"order='tp-dp-xp' .*\(unknown: \['xp'\]\)$"),  # (cp of size 1: not named)
    (dict(world_size=2, cp=2, order="cp-tp-cp"), r"order='cp-tp-cp' .*\(repeated: \['cp'\]\)$"),
    (dict(world_size=4, pp=2, order="tp-dp"), r"missing: \['pp'\]"),
    (dict(world_size=4, order="tp-tp-dp-pp"), r"repeated: \['tp'\]"),
])
def test_layout_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tp.layout(**kwargs)


@pytest.mark.parametrize("order,cp", [("tp-dp-pp", 1), ("pp-dp-tp", 1), ("tp-cp-dp-pp", 2), ("cp-pp-tp-dp", 2)])
@distributed(world_size=8)
def test_init_mesh_groups(order, cp):
    mesh = tp.init_mesh(tp=2, cp=cp, pp=2, order=order)
    rank = dist.get_rank()
    table = tp.layout(8, tp=2, cp=cp, pp=2, order=order)
    assert tp.get_mesh() is mesh and mesh.dp_size == 2 // cp and mesh.cp_size == cp
    assert mesh.cp_rank == mesh.local_rank("cp") and mesh.cp_group is mesh.group("cp")
    for axis in ("tp", "cp", "dp", "pp", "tp-pp", "tp-dp", "tp-cp", "dp-cp"):
        (mine,) = [g for g in table[axis] if rank in g]
        assert mesh.ranks(axis) == mine and mesh.size(axis) == len(mine)
        assert mesh.local_rank(axis) == mine.index(rank) == dist.get_rank(mesh.group(axis))
        # the group really connects those ranks: an all-gather of global ranks returns them
        out = torch.zeros(len(mine), dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.tensor([rank]), group=mesh.group(axis))
        assert out.tolist() == mine, axis
    pp_ranks = mesh.ranks("pp")
    assert mesh.is_first_stage == (rank == pp_ranks[0]) and mesh.is_last_stage == (rank == pp_ranks[-1])
    i = pp_ranks.index(rank)
    assert mesh.next_stage_rank == pp_ranks[(i + 1) % 2] and mesh.prev_stage_rank == pp_ranks[(i - 1) % 2]
    assert mesh.embedding_ranks == [pp_ranks[0], pp_ranks[-1]]
    dm = mesh.device_mesh
    names = order.split("-") + ["cp"] * ("cp" not in order)  # an axis left out is appended (slowest)
    assert dm.mesh_dim_names == tuple(reversed(names))
    for axis in ("tp", "cp", "dp", "pp"):
        assert sorted(dm[axis].mesh.flatten().tolist()) == mesh.ranks(axis)
        assert dm.get_local_rank(axis) == mesh.local_rank(axis)
    flat = mesh.flat_device_mesh("dp-cp")
    assert flat.mesh.tolist() == mesh.ranks("dp-cp") and flat.get_local_rank() == mesh.local_rank("dp-cp")


@pytest.mark.parametrize("ep,etp,pp", [(2, None, 1), (4, 1, 1), (2, 1, 2), (1, 1, 1)])
@distributed(world_size=8)
def test_init_mesh_expert_groups(ep, etp, pp):
    mesh = tp.init_mesh(tp=2, pp=pp, ep=ep, etp=etp)
    rank = dist.get_rank()
    table = tp.layout(8, tp=2, pp=pp, ep=ep, etp=etp)
    for axis in ("ep", "etp", "edp", "etp-ep", "tp-cp-dp"):
        (mine,) = [g for g in table[axis] if rank in g]
        assert mesh.ranks(axis) == mine and mesh.local_rank(axis) == mine.index(rank)
        out = torch.zeros(len(mine), dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.tensor([rank]), group=mesh.group(axis))
        assert out.tolist() == mine, axis
    etp = etp or 2
    assert (mesh.ep_size, mesh.etp_size, mesh.edp_size) == (ep, etp, 8 // (ep * etp * pp))
    assert (mesh.ep_rank, mesh.etp_rank, mesh.edp_rank) == tuple(mesh.local_rank(a) for a in ("ep", "etp", "edp"))
    assert mesh.ep_group is mesh.group("ep") and mesh.edp_group is mesh.group("edp")
    assert mesh.etp_group is mesh.group("etp")
    assert (f"ep={mesh.ep_rank}/{ep}" in repr(mesh)) == (ep > 1 or etp != 2)


@distributed(world_size=4)
def test_init_mesh_errors_raise_on_every_rank():
    with pytest.raises(ValueError, match="world_size=4 is not divisible by tp\\*pp=3\\*1=3"):
        tp.init_mesh(tp=3)
    with pytest.raises(ValueError, match="unknown: \\['xp'\\]"):
        tp.init_mesh(order="tp-cp-xp-dp-pp")
    with pytest.raises(ValueError, match=r"world_size=4 is not divisible by etp\*ep\*pp=2\*3\*1=6"):
        tp.init_mesh(tp=2, ep=3)
    with pytest.raises(ValueError, match="pipeline groups .* differ from the dense layout's"):
        tp.init_mesh(tp=2, pp=2, ep=1, etp=1, order="tp-pp-dp")
    assert tp.init_mesh(cp=2, pp=2, order="tp-cp-pp-dp").edp_size == 2  # no expert split: any dense order works
    tp.destroy_mesh()
    with pytest.raises(ValueError, match="missing: \\['cp'\\]"):
        tp.init_mesh(cp=2, order="tp-dp-pp")
    mesh = tp.init_mesh(tp=2)
    with pytest.raises(RuntimeError, match="already initialised"):
        tp.init_mesh(tp=2)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        mesh.group("xp")
    tp.destroy_mesh()
    with pytest.raises(RuntimeError, match="no tensor-parallel mesh"):
        tp.get_mesh()
    assert tp.init_mesh(tp=4).tp_size == 4  # after destroy, a new mesh can be made


def test_init_mesh_single_process_without_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    mesh = tp.init_mesh(backend="gloo")
    try:
        assert (mesh.world_size, mesh.tp_size, mesh.dp_size, mesh.pp_size) == (1, 1, 1, 1)
        layer = tp.ColumnParallelLinear(3, 4)
        assert layer(torch.ones(2, 3)).shape == (2, 4)
    finally:
        tp.destroy_mesh()
    assert not dist.is_initialized()  # the mesh created the default group, so it destroyed it too



def test_with_cuda_the_default_group_is_gloo_for_cpu_tensors_and_nccl_for_cuda_ones(monkeypatch):
    """An NCCL-only default group fails on every CPU tensor (a loader's indices, an optimizer's scalars): with CUDA
    visible the default is one group with both backends. (CUDA faked: the group's creation is intercepted.)"""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = []

    def init_process_group(backend, **kwargs):
        asked.append(backend)
        raise RuntimeError("intercepted")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(RuntimeError, match="intercepted"):
        tp.init_mesh()
    assert asked == ["cpu:gloo,cuda:nccl"]
    monkeypatch.undo()
    mesh = tp.init_mesh(backend="cpu:gloo")  # a per-device backend string: collectives on CPU tensors
    try:
        assert tp.mesh.collective_device() == torch.device("cpu")
        assert tp.ColumnParallelLinear(3, 4)(torch.ones(2, 3)).shape == (2, 4)
        assert mesh.world_size == 1
    finally:
        tp.destroy_mesh()

@distributed(world_size=4)
def test_destroy_mesh_can_keep_groups_for_the_next_mesh():
    mesh = tp.init_mesh(tp=2)
    tp_group, dp_group = mesh.tp_group, mesh.dp_group
    tp.destroy_mesh(keep_groups=True)
    again = tp.init_mesh(tp=2)
    assert again.tp_group is tp_group and again.dp_group is dp_group  # reused, not re-created
    out = torch.zeros(2, dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([dist.get_rank()]), group=again.tp_group)
    assert out.tolist() == again.ranks("tp")  # and still working
    tp.destroy_mesh()  # without keep_groups they are destroyed: the next mesh creates new ones
    assert tp.init_mesh(tp=2).tp_group is not tp_group


@distributed(world_size=2)
def test_a_destroyed_mesh_says_so():
    mesh = tp.init_mesh(tp=2)
    tp.destroy_mesh()
    for use in (lambda: mesh.tp_group, lambda: mesh.tp_rank, lambda: mesh.device_mesh):
        with pytest.raises(RuntimeError, match=r"this mesh was destroyed by tp.destroy_mesh\(\)"):
            use()


REINIT = """
import torch, torch.distributed as dist, tp
for tp_size in (2, 1, 2):
    mesh = tp.init_mesh(tp=tp_size)
    out = torch.zeros(2)
    dist.all_gather_into_tensor(out, torch.tensor([float(dist.get_rank())]))
    assert out.tolist() == [0.0, 1.0]
    tp.destroy_mesh()
assert dist.is_initialized()  # torchrun's default group is kept (re-creating it can hang in torch)
rank = dist.get_rank()
dist.destroy_process_group()
if rank == 0:  # (one rank prints: torchrun interleaves the ranks' output)
    print("reinit ok", dist.is_initialized())
"""


@pytest.mark.parametrize("runs", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_destroy_and_init_again_under_torchrun(tmp_path, runs):
    """init_mesh, destroy_mesh, init_mesh under torchrun: the default group it made from torchrun's environment is
    kept and reused (destroying and re-creating it hung in torch, intermittently: the slow run repeats it)."""
    import subprocess
    import sys

    script = tmp_path / "reinit.py"
    script.write_text(REINIT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for _ in range(runs):
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", str(script)], capture_output=True, text=True, timeout=120, env=env | {
                                     "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0 and "reinit ok False" in result.stdout, result.stderr[-2000:]  # both exit 0


def test_numpy_integers_are_sizes():
    import numpy as np

    assert tp.layout(8, tp=np.int64(2), pp=np.int32(2)) == tp.layout(8, tp=2, pp=2)
    with pytest.raises(ValueError, match=r"tp=.*2\.0\)? must be an integer >= 1"):
        tp.layout(8, tp=np.float64(2))


@distributed(world_size=4)
def test_a_new_mesh_gets_no_dtensor_of_a_destroyed_one():
    """DTensor caches sharding decisions by mesh equality (ranks and dim names, not groups): after destroy_mesh and a
    new mesh of the same shape, an op on the new mesh's DTensors must not return DTensors on the destroyed mesh (its
    groups gone: "Could not resolve the process group"; FSDP2 gradients accumulated after a re-initialisation)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for _ in range(2):
        mesh = tp.init_mesh(tp=2, dp=2)
        x = distribute_tensor(torch.arange(4.0), mesh.device_mesh["dp"], [Shard(0)])
        assert (x + x).device_mesh.get_group() is mesh.dp_group
        tp.destroy_mesh()


def test_print_layout_shows_the_expert_coordinates():
    from models.training import launch

    places = [(r // 4, r % 4, f"node{r // 4}") for r in range(8)]
    lines = launch.layout_lines(dict(tp=2, cp=1, pp=1, dp=4, ep=2), "tp-cp-dp-pp", places)
    assert lines[0] == "layout: 8 ranks on 2 nodes, tp=2 cp=1 pp=1 dp=4 ep=2 etp=2 edp=2 (order tp-cp-dp-pp)"
    assert " ".join(lines[2].split()) == "rank 0 local_rank 0 tp 0 cp 0 pp 0 dp 0 ep 0 etp 0 edp 0"
    assert [line.split()[-6:] for line in lines[2:6]] == [["ep", "0", "etp", "0", "edp", "0"],
                                                          ["ep", "0", "etp", "1", "edp", "0"],
                                                          ["ep", "1", "etp", "0", "edp", "0"],
                                                          ["ep", "1", "etp", "1", "edp", "0"]]
    assert "ep" not in launch.layout_lines(dict(tp=2, cp=1, pp=1, dp=4), "tp-cp-dp-pp", places)[0]


def _counting_barriers(calls):
    barrier = dist.barrier

    def counted(*args, **kwargs):
        calls.append(1)
        return barrier(*args, **kwargs)

    return counted


@distributed(world_size=4)
def test_destroying_groups_synchronises_the_ranks_before_the_teardown_and_before_the_next_groups():
    """Gloo groups torn down or created while another rank was still at the other step sometimes failed the next
    group's connection ("connectFullMesh failed ... Connection closed by peer": 4 in 60 destroy/init cycles on a loaded
    2-core machine; test_destroying_and_making_meshes_in_a_loop): a barrier at each step, and none when kept."""
    tp.init_mesh(tp=2)  # (after whatever the test before left to synchronise)
    calls = []
    dist.barrier, barrier = _counting_barriers(calls), dist.barrier
    try:
        tp.destroy_mesh(keep_groups=True)
        tp.init_mesh(tp=2)  # every group kept: nothing torn down, no barrier
        assert calls == []
        tp.destroy_mesh()
        assert calls == [1]
        tp.init_mesh(cp=2)
        assert calls == [1, 1]
        tp.destroy_mesh(keep_groups=True)
        tp.init_mesh(cp=2)
        assert calls == [1, 1]
    finally:
        dist.barrier = barrier


@pytest.mark.slow
@distributed(world_size=4, timeout=300)
def test_destroying_and_making_meshes_in_a_loop():
    for _ in range(60):
        tp.init_mesh(cp=2, pp=2, order="tp-cp-pp-dp")
        tp.destroy_mesh()
        mesh = tp.init_mesh(tp=2)
        out = torch.zeros(2, dtype=torch.int64)
        dist.all_gather_into_tensor(out, torch.tensor([dist.get_rank()]), group=mesh.tp_group)
        assert out.tolist() == mesh.ranks("tp")
        tp.destroy_mesh()
