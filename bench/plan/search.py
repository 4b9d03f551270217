"""The planner's search: every candidate plan of a model on N devices whose sizes divide (bench.plan.cli's docstring
says which), each evaluated (its memory, and its step time when it fits) and ranked fastest first.

`fixed` pins plan fields by their --fix keys (bench.plan.cli.FIXABLE); an evaluated plan is a row keyed as the table
and the JSON name them. Pipelines try the even split and Megatron's embedding-and-loss accounting (bench.plan.stages),
each with every number of virtual stages its layers divide into (interleaving also needs the micro-batches to be a
multiple of pp). Recompute: the granularities and the output-discarding modules (bench.plan.recompute). Mixtures of
experts also search ep (dividing the experts), etp (1 or tp: Megatron-Core's usual choices; any other by --fix) with
ep·etp dividing tp·cp·dp, and the token dispatchers the software implements.
"""
import contextlib
import functools
import itertools
import multiprocessing
import os
import sys
import time

from models.flops import matmul_params

from . import memory
from . import recompute as recomputing
from .software import OURS, OURS_CPU
from .stages import ACCOUNTED, EVEN, StageSplit, layer_counts
from .step_time import Plan, step_time

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)  # the sweep; --fix mbs=N plans any other
VIRTUAL_STAGES = (2, 3, 4, 6, 8)  # the interleaved sweep before it tried every vp the layers allow (kept for callers)
SPLIT_KEYS = ("first_layers", "last_layers", "account")  # --fix keys of an uneven split


def software_of(cluster):
    """The implementation that runs on the node: this package, in fp32 eager on the CPU profile."""
    return OURS_CPU if cluster.cores else OURS


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(fixed, key, value):
    """Whether --fix leaves `key` free or pins it to `value`."""
    return fixed.get(key, value) == value


def _splits_model(config, tp):
    try:
        config.check_tp(tp)
    except ValueError:
        return False
    return True


def _degrees(config, *, gpus, seq_len, global_batch_size, cluster, fixed):
    """(tp, cp, pp, dp) of `gpus` devices that divide the model, the sequence and the global batch; tp within a node
    unless pinned."""
    for tp in _divisors(gpus):
        within_node = tp <= cluster.device.gpus_per_node or "tp" in fixed
        if not (_allowed(fixed, "tp", tp) and within_node and _splits_model(config, tp)):
            continue
        for cp in _divisors(gpus // tp):
            if not _allowed(fixed, "cp", cp) or (cp > 1 and seq_len % (2 * cp)):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if _allowed(fixed, "pp", pp) and _allowed(fixed, "dp", dp) and pp <= config.num_layers and \
                        global_batch_size % dp == 0:
                    yield tp, cp, pp, dp


def stage_split(fixed):
    """The StageSplit --fix names (first_layers, last_layers, account), or None when it names none."""
    if not any(key in fixed for key in SPLIT_KEYS):
        return None
    account = fixed.get("account", "none")
    return StageSplit(fixed.get("first_layers"), fixed.get("last_layers"), "embedding" in account, "loss" in account)


def _virtual_stages(config, pp, micro_batches, split, fixed):
    """1 and every V >= 2 whose chunks the split's layers fill evenly (interleaving: micro-batches a multiple of pp,
    Megatron's schedule), or --fix's."""
    interleaves = pp > 1 and micro_batches % pp == 0
    candidates = (fixed["vp"],) if "vp" in fixed else (1, *(range(2, config.num_layers // pp + 2) if interleaves
                                                            else ()))
    for virtual_stages in candidates:
        if virtual_stages > 1 and not interleaves:
            continue
        try:
            layer_counts(config.num_layers, pp, virtual_stages, split)
        except ValueError:
            continue
        yield virtual_stages


def _micro_batching(config, pp, dp, global_batch_size, fixed):
    """(micro-batch size, virtual stages, stage split): the micro-batches split each dp rank's share of the batch;
    the splits: --fix's, else even and (pp > 1) the embedding and loss accounted."""
    splits = [stage_split(fixed)] if stage_split(fixed) else [EVEN] + ([ACCOUNTED] if pp > 1 else [])
    for micro_batch_size in (fixed["mbs"],) if "mbs" in fixed else MICRO_BATCH_SIZES:
        if (global_batch_size // dp) % micro_batch_size:
            continue
        micro_batches = global_batch_size // (dp * micro_batch_size)
        for split in splits:
            for virtual_stages in _virtual_stages(config, pp, micro_batches, split, fixed):
                yield micro_batch_size, virtual_stages, split


def _options(config, tp, cp, dp, seq_len, fixed, software):
    """(recompute, sequence parallel, dp mode): SP where tp > 1 and the sequence splits over 2·cp·tp; a dp mode the
    software runs, other than ddp where gradients are reduced over more than one rank (dp·cp)."""
    for recompute in (fixed["recompute"],) if "recompute" in fixed else recomputing.search_choices(config):
        for sp in (False, True) if tp > 1 else (False,):
            split = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
            if not _allowed(fixed, "sp", "on" if sp else "off") or seq_len % split:
                continue
            for dp_mode in memory.DP_MODES if dp * cp > 1 else ("ddp",):
                if _allowed(fixed, "dp_mode", dp_mode) and dp_mode not in software.lacks_dp_modes:
                    yield recompute, sp, dp_mode


def _experts(config, tp, cp, dp, fixed, software):
    """(ep, etp, dispatcher) of a mixture of experts on one stage's tp·cp·dp ranks: ep dividing the experts, etp 1 or
    tp (or --fix's) dividing the experts' FFN, ep·etp dividing tp·cp·dp, the software's dispatchers (or --fix's);
    (1, tp, the first) for a dense model."""
    if not config.num_experts:
        if _allowed(fixed, "ep", 1) and _allowed(fixed, "etp", tp):
            yield 1, tp, software.dispatchers[0]
        return
    for etp in sorted({fixed["etp"]} if "etp" in fixed else {1, tp}):
        for ep in _divisors(tp * cp * dp):
            if _allowed(fixed, "ep", ep) and (tp * cp * dp) % (ep * etp) == 0 and config.num_experts % ep == 0 \
                    and config.moe_ffn_hidden_size % etp == 0:
                for dispatcher in (fixed["dispatcher"],) if "dispatcher" in fixed else \
                        software.dispatchers if ep > 1 else software.dispatchers[:1]:
                    yield ep, etp, dispatcher


def candidate_plans(config, *, gpus, seq_len, global_batch_size, cluster, fixed, software=None):
    """Every plan whose sizes divide, before memory."""
    fixed, software = dict(fixed), software or software_of(cluster)
    for tp, cp, pp, dp in _degrees(config, gpus=gpus, seq_len=seq_len, global_batch_size=global_batch_size,
                                   cluster=cluster, fixed=fixed):
        for ep, etp, dispatcher in _experts(config, tp, cp, dp, fixed, software):
            for micro_batch_size, virtual_stages, split in _micro_batching(config, pp, dp, global_batch_size, fixed):
                for recompute, sp, dp_mode in _options(config, tp, cp, dp, seq_len, fixed, software):
                    yield Plan(tp, cp, pp, virtual_stages, dp, micro_batch_size, recompute, sp, dp_mode, ep, etp,
                               dispatcher, split)


def parameter_counts(config):
    """(active, total) parameters of the whole model: every weight (embeddings included), and those a token goes
    through (an MoE layer's k routed experts, not its E)."""
    total = memory.stage_numel(config, 1)
    return total - (matmul_params(config, active=False) - matmul_params(config)), total


def plan_memory(config, plan, *, seq_len, global_batch_size, software):
    """bench.plan.memory's estimate of the plan's largest stage."""
    precision = "bf16" if software.precision in ("bf16", "fp16") else "fp32"
    return memory.estimate(config, tp=plan.tp, cp=plan.cp, pp=plan.pp, dp=plan.dp,
                           micro_batch_size=plan.micro_batch_size, seq_len=seq_len, sequence_parallel=plan.sp,
                           recompute=plan.recompute, dp_mode=plan.dp_mode, precision=precision,
                           virtual_stages=plan.virtual_stages, schedule=plan.schedule,
                           micro_batches=global_batch_size // (plan.dp * plan.micro_batch_size),
                           backend=software.backend, ep=plan.ep, etp=plan.etp,
                           optimizer_bytes=software.optimizer_bytes, grad_bytes=software.grad_bytes,
                           split=plan.split, fsdp_reshard=software.fsdp_reshard)


def evaluate(config, plan, *, seq_len, global_batch_size, cluster, software, with_time=True, counts=None):
    """One row: the plan, its memory, and (if it fits, or with_time) its modelled step. `counts`: the config's
    parameter_counts, when the caller has them (a search evaluates thousands of plans of one config)."""
    estimate = plan_memory(config, plan, seq_len=seq_len, global_batch_size=global_batch_size, software=software)
    usable = cluster.memory - cluster.reserved
    row = {"tp": plan.tp, "cp": plan.cp, "pp": plan.pp, "vp": plan.virtual_stages, "dp": plan.dp,
           "mbs": plan.micro_batch_size, "recompute": plan.recompute, "sp": "on" if plan.sp else "off",
           "dp_mode": plan.dp_mode, "ep": plan.ep, "etp": plan.expert_tp, "dispatcher": plan.dispatcher,
           "split": plan.split.label(), "memory_per_gpu_gb": estimate.total / 1e9,
           "fits": estimate.total <= usable, "memory": estimate.as_dict()}
    row["active_params"], row["total_params"] = counts or parameter_counts(config)
    if row["fits"] or with_time:
        row.update(step_time(config, plan, seq_len=seq_len, global_batch_size=global_batch_size, cluster=cluster,
                             software=software))
    return row


def search(config, *, gpus, seq_len, global_batch_size, cluster, fixed=(), software=None, progress=None,
           workers=None):
    """(feasible rows best first, the smallest-memory infeasible row or None, number of candidate plans). `progress`:
    called as progress(done, total, feasible, seconds) every PROGRESS_EVERY seconds of a longer search. `workers`:
    processes evaluating the plans (None: one per core this process may use; 1: this process alone); a search of
    fewer than PARALLEL_PLANS plans, or off Linux (_pool), runs here. The result is the same either way."""
    software = software or software_of(cluster)
    plans = list(candidate_plans(config, gpus=gpus, seq_len=seq_len, global_batch_size=global_batch_size,
                                 cluster=cluster, fixed=fixed, software=software))
    evaluate_part = functools.partial(_evaluate_part, config, plans, seq_len=seq_len,
                                      global_batch_size=global_batch_size, cluster=cluster, software=software,
                                      counts=parameter_counts(config))
    parts = [range(i, min(i + PART_PLANS, len(plans))) for i in range(0, len(plans), PART_PLANS)]
    workers = min(workers or _usable_cores(), len(parts))
    rows, smallest = [], None
    start = last = time.monotonic()
    with _pool(workers if len(plans) >= PARALLEL_PLANS else 1, evaluate_part) as pool:
        for done, (fit, unfit) in zip(itertools.accumulate(map(len, parts)),
                                      pool.imap(_forked_part, parts) if pool else map(evaluate_part, parts)):
            rows += fit  # (in the plans' order, part after part: ties rank as in one process)
            if unfit is not None and (smallest is None or unfit["memory_per_gpu_gb"] < smallest["memory_per_gpu_gb"]):
                smallest = unfit
            if progress and time.monotonic() - last >= PROGRESS_EVERY:
                last = time.monotonic()
                progress(done, len(plans), len(rows), last - start)
    rows.sort(key=rank_key)
    return rows, smallest, len(plans)


def _evaluate_part(config, plans, indices, **where):
    """(the rows of plans[indices] that fit, in order; the first smallest-memory one that does not, or None)."""
    fit, smallest = [], None
    for i in indices:
        row = evaluate(config, plans[i], with_time=False, **where)
        if row["fits"]:
            fit.append(row)
        elif smallest is None or row["memory_per_gpu_gb"] < smallest["memory_per_gpu_gb"]:
            smallest = row
    return fit, smallest


def _usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_FORKED_WORK = None  # (in a pool's process: the search's evaluate_part, inherited through fork)


def _set_forked_work(work):
    global _FORKED_WORK
    _FORKED_WORK = work


def _forked_part(indices):
    return _FORKED_WORK(indices)


@contextlib.contextmanager
def _pool(workers, work):
    """A pool of `workers` processes forked from this one, running `work` on parts of the plans (they inherit it
    with the plans and the memo tables: only the parts' indices and the rows are pickled), or None for this process
    alone: one worker, not Linux (macOS can fork but its system libraries are not fork-safe), or this process a
    daemon (a multiprocessing worker may not start processes)."""
    if workers <= 1 or sys.platform != "linux" or multiprocessing.current_process().daemon:
        yield None
        return
    with multiprocessing.get_context("fork").Pool(workers, initializer=_set_forked_work, initargs=(work,)) as pool:
        yield pool


PART_PLANS = 1000  # plans per task of a parallel search
PARALLEL_PLANS = 4000  # smaller searches take ~2 s in one process: a pool's start-up is not worth it
PROGRESS_EVERY = 5.0  # seconds between progress reports of a long search


def recompute_order(recompute):
    """How much `recompute` recomputes, for ranking: the granularities in order, modules (no whole layer) after none."""
    return memory.RECOMPUTE.index(recompute) if recompute in memory.RECOMPUTE else 0.5


def rank_key(row):
    """Fastest first; plans the model times alike (to 9 digits: e.g. recompute hidden behind an exposed reduce, or
    cp·mbs constant) rank the simpler first — without cp, with less recompute, without interleaving, an even split,
    less memory."""
    return (-float(f"{row['tokens_per_s']:.9g}"), row["cp"], recompute_order(row["recompute"]), row["vp"],
            row["split"] != "even", row["memory_per_gpu_gb"])
