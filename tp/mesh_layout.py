"""The hybrid mesh's layout, arithmetic only (no process group; tp/mesh.py creates the groups): ranks grouped into
tensor (tp), context (cp), data (dp) and pipeline (pp) groups in Megatron's rank order, and the same ranks grouped
again for the experts of mixture-of-experts layers.

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
import itertools
import numbers

AXES = ("tp", "cp", "dp", "pp")
# "tp-pp": model-parallel (a parameter's shards); "dp-cp": the group gradients are reduced over; "tp-cp": the ranks
# that share one micro-batch (the loss is equal on all of them); "tp-cp-dp": one pipeline stage's ranks, which hold
# the tokens of all the data-parallel micro-batches of a step (a mixture of experts' load statistics cover them)
COMPOSITES = ("tp-pp", "tp-dp", "tp-cp", "dp-cp", "tp-cp-dp")
# The expert layout's axes (Megatron-Core's expert RankGenerator: its "tp", "ep", "dp" are etp, ep, edp) and groups
EXPERT_AXES = ("etp", "ep", "edp")
EXPERT_GROUPS = ("ep", "etp", "edp", "etp-ep")
_EXPERT_NAMES = {"tp": "etp", "dp": "edp", "ep": "ep", "pp": "pp"}  # order token -> expert axis
DEFAULT_ORDER = "tp-cp-dp-pp"


def parse_order(order: str, sizes: dict[str, int] | None = None) -> list[str]:
    """The dense axes of `order`, fastest first (an "ep" in it dropped: the dense layout has no ep), with the axes it
    leaves out appended (each must have size 1 in `sizes`)."""
    tokens = order.split("-") if isinstance(order, str) else []
    repeated = sorted({a for a in tokens if tokens.count(a) > 1})
    axes = [a for a in tokens if a != "ep"]
    unknown = [a for a in axes if a not in AXES]
    missing = [a for a in AXES if a not in axes and sizes is not None and sizes[a] > 1]
    if unknown or repeated or not axes or missing:
        wrong = ", ".join(f"{what}: {names}" for what, names in (("unknown", unknown), ("missing", missing),
                                                                 ("repeated", repeated)) if names)
        raise ValueError(f"order={order!r} must list each of {'/'.join(AXES)}/ep at most once, and every axis of "
                         f"size > 1 ({wrong or 'no axis'})")
    return axes + [a for a in AXES if a not in axes]


def _integer(name, value):
    """value as an int, refused unless an integer (any integer type, numpy's too, not bool) >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


def dense_sizes(world_size: int, tp: int, pp: int, dp: int | None, cp: int = 1) -> dict[str, int]:
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


def expert_sizes(world_size: int, sizes: dict[str, int], ep: int, etp: int | None) -> dict[str, int]:
    """{etp, ep, edp, pp} of the expert layout: etp defaults to tp, edp = world / (etp·ep·pp)."""
    ep = _integer("ep", ep)
    etp = sizes["tp"] if etp is None else _integer("etp", etp)
    pp = sizes["pp"]
    if world_size % (etp * ep * pp):
        raise ValueError(f"world_size={world_size} is not divisible by etp*ep*pp={etp}*{ep}*{pp}={etp * ep * pp} "
                         "(the expert layout)")
    return {"etp": etp, "ep": ep, "edp": world_size // (etp * ep * pp), "pp": pp}


def expert_order(order: str, esizes: dict[str, int]) -> list[str]:
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


def layout(world_size: int, *, tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None, ep: int = 1,
           etp: int | None = None, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """Rank groups per axis ("tp", "cp", "dp", "pp") and composite ("tp-pp" model-parallel, "tp-dp", "tp-cp",
    "dp-cp", "tp-cp-dp" one stage), each as megatron-core's RankGenerator lists them, and the expert layout's "ep",
    "etp", "edp" and "etp-ep" (its RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1)'s "ep", "tp", "dp" and
    "tp-ep"; with ep = 1 and etp = tp simply the singletons, "tp", "dp-cp" and "tp"); no process group needed."""
    sizes = dense_sizes(world_size, tp, pp, dp, cp)
    axes = parse_order(order, sizes)
    table = {name: _groups(sizes, axes, name.split("-")) for name in AXES + COMPOSITES}
    esizes = expert_sizes(world_size, sizes, ep, etp)
    if esizes["ep"] == 1 and esizes["etp"] == sizes["tp"]:  # experts not split: the dense groups, whatever the order
        return table | {"ep": [[r] for r in range(world_size)], "etp": table["tp"], "edp": table["dp-cp"],
                        "etp-ep": table["tp"]}
    eaxes = expert_order(order, esizes)
    expert = {name: _groups(esizes, eaxes, name.split("-")) for name in EXPERT_GROUPS + ("pp",)}
    if expert["pp"] != table["pp"]:
        raise ValueError(f"etp={esizes['etp']}, ep={esizes['ep']} with order={order!r}: the expert layout's pipeline "
                         f"groups ({expert['pp'][0]}, ...) differ from the dense layout's ({table['pp'][0]}, ...); "
                         "put pp last in the order (the default), or use etp = tp")
    return table | {name: expert[name] for name in EXPERT_GROUPS}
