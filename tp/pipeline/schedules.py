"""Pipeline schedules as data: generators of per-rank action lists, and a simulator that checks and times them.

A schedule is a pure function `(pp, micro_batches, virtual_stages) -> Schedule`: for each pipeline rank, the list of
actions it runs in order. An action is F (forward), B (backward of the input: dgrad, on the critical path), W
(backward of the weights: wgrad, deferrable) or BW (the fused backward), each of one model chunk on one micro-batch.
Chunk c of rank r holds virtual stage c·p + r (Megatron's interleaving; with one chunk, stage r). The transfers are
derived, not listed: F of stage s sends its output to stage s+1's rank, B/BW of stage s sends its input's gradient
to stage s-1's rank (two chunks on one rank hand over locally).

`simulate(schedule, costs)` runs the lists against per-action costs (F, B, W of one micro-batch through a whole
rank's layers; a chunk costs 1/V of that, the fused BW costs B + W; or, with `stage_costs`, each virtual stage's own
F, B, W), with every action starting once its inputs
exist: it raises ScheduleError on a deadlock or a broken dependency, and returns the timeline, the bubble fraction
(idle / (stages x span)) and the peak activations (the most forward chunks awaiting their B on any rank, in
micro-batches through a whole stage: a chunk counts 1/V).

Closed forms for unit costs (F = B = W = 1), which the simulator reproduces (tests/test_schedules.py):
- gpipe, 1f1b: bubble (p-1)/(m+p-1); peak m (GPipe) and min(p, m) (1F1B).
- interleaved: (p-1)/(V·m+p-1); peak <= p + (p-1)/V.
- zb (ZB-H1, Qi et al. 2024): <= (p-1)/(3m+p-1) for m >= p, i.e. an idle (p-1)(F+B-W) per rank; peak <= p.

SCHEDULES is the one list of schedules (the job's --schedule, the planner and the benchmarks read it): name ->
ScheduleKind, the generator with what the others need to know of it (whether it interleaves or splits backward, its
closed forms). A new schedule is its generator and its line there.
"""
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

KINDS = ("F", "B", "W", "BW")


class ScheduleError(ValueError):
    """A schedule that cannot run: a deadlock, a missing or repeated action, or an action before its inputs."""


class Action(NamedTuple):
    kind: str  # "F" | "B" | "W" | "BW"
    chunk: int  # the model chunk on this rank (0 <= chunk < virtual_stages)
    micro: int  # the micro-batch

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


class Message(NamedTuple):
    kind: str  # "act" (F's output, forward) | "grad" (B's input gradient, backward)
    stage: int  # the virtual stage that receives it
    micro: int


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    micro_batches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]  # per rank: its Actions in order

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def backward(self) -> bool:
        """False for a forward-only (evaluation) schedule."""
        return any(a.kind != "F" for rank in self.actions for a in rank)

    @property
    def split_backward(self) -> bool:
        """True when backward runs as B and W (the layers must defer their weight gradients)."""
        return any(a.kind == "B" for rank in self.actions for a in rank)

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage chunk `chunk` of `rank` holds."""
        return chunk * self.pp + rank

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage `stage`."""
        return stage % self.pp, stage // self.pp

    def sends(self, rank: int, action: Action) -> list[tuple[Message, int]]:
        """[(message, destination rank)] that `action` on `rank` produces."""
        s = self.stage(rank, action.chunk)
        if action.kind == "F" and s + 1 < self.num_stages:
            return [(Message("act", s + 1, action.micro), self.place(s + 1)[0])]
        if action.kind in ("B", "BW") and s > 0:
            return [(Message("grad", s - 1, action.micro), self.place(s - 1)[0])]
        return []

    def receives(self, rank: int, action: Action) -> list[tuple[Message, int]]:
        """[(message, source rank)] that `action` on `rank` needs before it starts."""
        s = self.stage(rank, action.chunk)
        if action.kind == "F" and s > 0:
            return [(Message("act", s, action.micro), self.place(s - 1)[0])]
        if action.kind in ("B", "BW") and s + 1 < self.num_stages:
            return [(Message("grad", s, action.micro), self.place(s + 1)[0])]
        return []


# ---- generators ------------------------------------------------------------------------------------------------


def check_arguments(name: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """Raise ScheduleError (one line naming the value) if schedule `name` cannot run these sizes."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule={name!r} must be one of {tuple(SCHEDULES)}")
    for what, value in (("pp", pp), ("micro_batches", micro_batches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{what}={value!r} must be an integer >= 1")
    if SCHEDULES[name].interleaves:
        _check_chunks(name, pp, micro_batches, virtual_stages)
    elif virtual_stages != 1:
        chunked = " or ".join(repr(n) for n, kind in SCHEDULES.items() if kind.interleaves)
        raise ScheduleError(f"virtual_stages={virtual_stages}: schedule {name!r} runs one model chunk per rank "
                            f"(virtual stages are for {chunked})")


def _check_chunks(name, pp, micro_batches, virtual_stages):
    """Megatron's conditions on an interleaved schedule's sizes."""
    if pp < 2:
        raise ScheduleError(f"schedule {name!r} needs pp >= 2 pipeline stages, got pp={pp}")
    if virtual_stages < 2:
        raise ScheduleError(f"schedule {name!r} needs virtual_stages >= 2 model chunks per rank, got "
                            f"virtual_stages={virtual_stages} (one chunk per rank is '1f1b')")
    if micro_batches < pp:  # Megatron: the micro-batch group (p) must lie in [p, m]
        raise ScheduleError(f"schedule {name!r} needs micro_batches >= pp: micro_batches={micro_batches} < "
                            f"pp={pp}")
    if micro_batches % pp:  # Megatron: the last group of m mod p < p micro-batches would stall the pipeline
        raise ScheduleError(f"schedule {name!r} needs micro_batches divisible by pp: micro_batches="
                            f"{micro_batches} is not a multiple of pp={pp}")


def gpipe(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Every forward, then every backward (fused), on every rank."""
    check_arguments("gpipe", pp, micro_batches, virtual_stages)
    m = micro_batches
    ranks = [[Action("F", 0, k) for k in range(m)] + [Action("BW", 0, k) for k in range(m)] for _ in range(pp)]
    return _schedule("gpipe", pp, m, 1, ranks)


def one_f_one_b(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """PipeDream-Flush: rank r runs min(p-r-1, m) warm-up forwards, then one forward one backward, then the rest."""
    check_arguments("1f1b", pp, micro_batches, virtual_stages)
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, micro_batches)
        order = [Action("F", 0, k) for k in range(warmup)]
        for k in range(warmup, micro_batches):
            order += [Action("F", 0, k), Action("BW", 0, k - warmup)]
        order += [Action("BW", 0, k) for k in range(micro_batches - warmup, micro_batches)]
        ranks.append(order)
    return _schedule("1f1b", pp, micro_batches, 1, ranks)


def interleaved(pp: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: micro-batches in groups of p go through chunk 0, 1, ..., V-1 of each rank
    (backward through V-1, ..., 0); rank r warms up with 2(p-r-1) + (V-1)·p forwards, then alternates."""
    check_arguments("interleaved", pp, micro_batches, virtual_stages)
    p, m, v = pp, micro_batches, virtual_stages
    # Megatron's schedule table: (micro-batch, chunk) of the i-th forward; the i-th backward takes chunk V-1-chunk.
    table = [(k, c) for start in range(0, m, p) for c in range(v) for k in range(start, min(start + p, m))]
    total = len(table)
    ranks = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        forwards = [Action("F", c, k) for k, c in table]
        backwards = [Action("BW", v - 1 - c, k) for k, c in table]
        order = forwards[:warmup]
        for i in range(total - warmup):
            order += [forwards[warmup + i], backwards[i]]
        order += backwards[total - warmup:]
        ranks.append(order)
    return _schedule("interleaved", p, m, v, ranks)


def zero_bubble(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """ZB-H1: 1F1B with the backward split into B and W; rank r holds back its first r W's and runs each later W
    after the next B (torch.pipelining's ordering), so the last ranks fill the drain with weight gradients. Same
    warm-up as 1F1B, hence 1F1B's peak activations."""
    check_arguments("zb", pp, micro_batches, virtual_stages)
    m, ranks = micro_batches, []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order, backwards, weights = [Action("F", 0, k) for k in range(warmup)], 0, 0
        for step in range(m):
            if warmup + step < m:
                order.append(Action("F", 0, warmup + step))
            order.append(Action("B", 0, backwards))
            backwards += 1
            if step >= r:  # rank r runs its W's r steps behind its B's
                order.append(Action("W", 0, weights))
                weights += 1
        order += [Action("W", 0, k) for k in range(weights, m)]
        ranks.append(order)
    return _schedule("zb", pp, m, 1, ranks)


def forward_only(pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Evaluation: only forwards, each rank through its chunks in Megatron's interleaved order (micro-batches in
    groups of p per chunk; with one chunk, in order). Any m."""
    p, v = pp, virtual_stages
    table = [(k, c) for start in range(0, micro_batches, p) for c in range(v)
             for k in range(start, min(start + p, micro_batches))]
    return _schedule("forward", p, micro_batches, v, [[Action("F", c, k) for k, c in table] for _ in range(p)])


# ---- the registry: each schedule's generator and the closed forms planners and benchmarks read ------------------


def _all_in_flight(pp, stage, virtual_stages, micro_batches):
    """GPipe: every micro-batch's activations alive before the first backward."""
    if micro_batches is None:
        raise ValueError("schedule='gpipe' keeps every micro-batch alive: give micro_batches")
    return micro_batches


def _one_chunk_in_flight(pp, stage, virtual_stages, micro_batches):
    """1F1B's warm-up: rank r holds p - r micro-batches (fewer when m < p)."""
    return pp - stage if micro_batches is None else min(pp - stage, micro_batches)


def _interleaved_in_flight(pp, stage, virtual_stages, micro_batches):
    """Rank r warms up with 2(p-r-1) + (V-1)p chunk forwards, and holds one more at its first backward."""
    chunks = (pp - stage - 1) * 2 + (virtual_stages - 1) * pp + 1
    if micro_batches is not None:
        chunks = min(chunks, micro_batches * virtual_stages)
    return chunks / virtual_stages


def _bubble(pp, micro_batches, virtual_stages):
    """(p-1)/(V·m+p-1): GPipe and 1F1B at V = 1 (Huang et al. 2019), interleaved (Narayanan et al. 2021)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


def _zero_bubble_bound(pp, micro_batches, virtual_stages):
    """ZB-H1's bound (p-1)/(3m+p-1) for m >= p (Qi et al. 2024); None below."""
    return (pp - 1) / (3 * micro_batches + pp - 1) if micro_batches >= pp else None


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule of the registry: its generator, and what a planner or benchmark needs to know of it."""

    generate: Callable[[int, int, int], Schedule]  # (pp, micro_batches, virtual_stages) -> Schedule
    title: str  # as the literature names it
    # the unit-cost bubble fraction (pp, micro_batches, virtual_stages), None where there is no closed form; exact
    # unless `bubble_bound` (then an upper bound)
    bubble: Callable[[int, int, int], float | None]
    # micro-batches of whole-stage activations alive at once on one rank (pp, stage, virtual_stages, micro_batches
    # or None: the worst case over m), as the simulator's peaks count them
    in_flight: Callable[[int, int, int, int | None], float]
    interleaves: bool = False  # runs V >= 2 model chunks per rank (virtual stages; else exactly one)
    split_backward: bool = False  # backward as B and W (the layers defer their weight gradients to W)
    bubble_bound: bool = False

    def __call__(self, pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
        return self.generate(pp, micro_batches, virtual_stages)


# name -> schedule: the one list of schedules (the job's --schedule, bench.schedule, bench.train, the planner)
SCHEDULES = {
    "gpipe": ScheduleKind(gpipe, "GPipe", _bubble, _all_in_flight),
    "1f1b": ScheduleKind(one_f_one_b, "1F1B", _bubble, _one_chunk_in_flight),
    "interleaved": ScheduleKind(interleaved, "interleaved", _bubble, _interleaved_in_flight, interleaves=True),
    "zb": ScheduleKind(zero_bubble, "ZB-H1", _zero_bubble_bound, _one_chunk_in_flight, split_backward=True,
                       bubble_bound=True),
}


def build(name: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule `name` (one of SCHEDULES) for p ranks, m micro-batches, V chunks."""
    check_arguments(name, pp, micro_batches, virtual_stages)
    return SCHEDULES[name](pp, micro_batches, virtual_stages)


def _schedule(name, pp, m, v, ranks):
    return Schedule(name, pp, m, v, tuple(tuple(order) for order in ranks))


# ---- checking and simulation -----------------------------------------------------------------------------------


@dataclass
class Timeline:
    schedule: Schedule
    costs: tuple[float, float, float]  # (F, B, W) of a micro-batch through a whole rank's layers
    intervals: list[list[tuple[float, float, Action]]]  # per rank: [(start, end, Action)] in execution order
    span: float  # the last action's end (every rank starts at 0)
    busy: list[float]  # per rank: the time it computes
    peaks: list[float]  # per rank: the most forward chunks awaiting their B at once (a chunk counts 1/V)
    sent: dict[Message, float] = field(default_factory=dict)  # Message -> the time it was sent

    @property
    def bubble_fraction(self) -> float:
        """Idle over stages x span: the fraction of the pipeline's time nobody computes."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.span) if self.span else 0.0

    @property
    def peak_activations(self) -> float:
        return max(self.peaks)


def check_actions(schedule: Schedule) -> None:
    """Raise ScheduleError unless every rank runs, for each of its chunks and micro-batches, one F and then either
    one BW or one B followed by one W (the order within a rank; dependencies across ranks are simulate()'s)."""
    expected = {(c, k) for c in range(schedule.virtual_stages) for k in range(schedule.micro_batches)}
    if len(schedule.actions) != schedule.pp:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for pp={schedule.pp} ranks")
    for r, order in enumerate(schedule.actions):
        done = {}
        for i, a in enumerate(order):
            where = f"{schedule.name}: rank {r}, action {i} ({a!r})"
            if a.kind not in KINDS or (a.chunk, a.micro) not in expected:
                raise ScheduleError(f"{where}: no such action (chunks < {schedule.virtual_stages}, micro-batches < "
                                    f"{schedule.micro_batches})")
            seen = done.setdefault((a.chunk, a.micro), [])
            before = {"F": [], "B": ["F"], "BW": ["F"], "W": ["F", "B"]}[a.kind]
            if seen != before:
                raise ScheduleError(f"{where}: follows {seen or 'nothing'} of its micro-batch and chunk, expected "
                                    f"{before or 'nothing'}")
            seen.append(a.kind)
        complete = (["F"],) if not schedule.backward else (["F", "BW"], ["F", "B", "W"])
        missing = sorted(key for key in expected if done.get(key) not in complete)
        if missing:
            c, k = missing[0]
            raise ScheduleError(f"{schedule.name}: rank {r} does not complete micro-batch {k} of chunk {c} "
                                f"(has {done.get((c, k), [])})")


def _stage_costs(schedule, costs, stage_costs):
    """[{kind: seconds}] per virtual stage: `stage_costs` (F, B, W) of each, or a rank's `costs` split over V."""
    if stage_costs is None:
        if len(costs) != 3 or any(not c >= 0 for c in costs):
            raise ScheduleError(f"costs={tuple(costs)} must be three numbers >= 0 (F, B, W)")
        stage_costs = [tuple(c / schedule.virtual_stages for c in costs)] * schedule.num_stages
    if len(stage_costs) != schedule.num_stages or any(len(c) != 3 or any(not x >= 0 for x in c)
                                                      for c in stage_costs):
        raise ScheduleError(f"stage_costs must give (F, B, W) >= 0 for each of the {schedule.num_stages} virtual "
                            f"stages, got {len(stage_costs)}")
    return [{"F": f, "B": b, "W": w, "BW": b + w} for f, b, w in stage_costs]


def simulate(schedule: Schedule, costs: Sequence[float] = (1.0, 1.0, 1.0),
             stage_costs: Sequence[Sequence[float]] | None = None) -> Timeline:
    """Run the action lists with these (F, B, W) costs, each action as soon as its rank is free and its inputs have
    arrived (transfers take no time). `costs` are a micro-batch's through a whole rank (a chunk costs 1/V);
    `stage_costs`, where stages differ (uneven splits, the embedding and the loss), give each virtual stage's own
    (F, B, W) instead. Raises ScheduleError on a deadlock; returns the Timeline."""
    check_actions(schedule)
    per_stage = _stage_costs(schedule, costs, stage_costs)
    p = schedule.pp
    position, clock = [0] * p, [0.0] * p
    intervals, busy = [[] for _ in range(p)], [0.0] * p
    sent = {}
    while True:
        progressed = False
        for r in range(p):
            order = schedule.actions[r]
            while position[r] < len(order):
                a = order[position[r]]
                needs = [m for m, _ in schedule.receives(r, a)]
                if any(m not in sent for m in needs):
                    break
                start = max([clock[r], *(sent[m] for m in needs)])
                end = start + per_stage[schedule.stage(r, a.chunk)][a.kind]
                intervals[r].append((start, end, a))
                busy[r] += end - start
                clock[r] = end
                for m, _ in schedule.sends(r, a):
                    sent[m] = end
                position[r] += 1
                progressed = True
        if all(position[r] == len(schedule.actions[r]) for r in range(p)):
            break
        if not progressed:
            stuck = ", ".join(f"rank {r} at {schedule.actions[r][position[r]]!r} (waits for "
                              f"{[tuple(m) for m, _ in schedule.receives(r, schedule.actions[r][position[r]])]})"
                              for r in range(p) if position[r] < len(schedule.actions[r]))
            raise ScheduleError(f"{schedule.name}: deadlock: {stuck}")
    return Timeline(schedule, tuple(costs), intervals, max(clock), busy, _peaks(schedule), sent)


def _peaks(schedule):
    """Per rank, the most forward chunks awaiting their B (or BW) at once, in micro-batches through a whole stage."""
    peaks = []
    for order in schedule.actions:
        alive = peak = 0
        for a in order:
            alive += {"F": 1, "B": -1, "BW": -1}.get(a.kind, 0)
            peak = max(peak, alive)
        peaks.append(peak / schedule.virtual_stages)
    return peaks


def pair_order(schedule: Schedule,
               timeline: Timeline | None = None) -> dict[tuple[int, int], list[tuple[Message, int, int]]]:
    """{(rank a, rank b) with a < b: [(Message, source, destination)]}: the transfers between two ranks in one order
    both agree on (by the unit-cost simulation's send time). Issuing each pair's sends and receives in this order
    never makes one rank's queue wait on an operation the other issues later (NCCL's stream order needs this)."""
    timeline = timeline or simulate(schedule)
    pairs = {}
    for r, order in enumerate(schedule.actions):
        for a in order:
            for message, dst in schedule.sends(r, a):
                if dst != r:
                    pairs.setdefault((min(r, dst), max(r, dst)), []).append((message, r, dst))
    for transfers in pairs.values():
        transfers.sort(key=lambda t: (timeline.sent[t[0]], t[0]))
    return pairs
