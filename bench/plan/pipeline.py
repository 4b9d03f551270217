"""The pipeline's span when its virtual stages cost differently (uneven splits: Megatron's first/last stage layers,
the embedding and loss accounted): tp.pipeline.schedules' simulator run on each virtual stage's own (F, B, W).

Simulating every micro-batch of a large step is slow (the simulator is a plain event loop), so the span is simulated
exactly up to 2·p micro-batches and beyond that extended by the slope of its last p: span(m) = span(2p) + (m − 2p) ·
(span(2p) − span(p)) / p. Past the warm-up a pipeline adds the same time per round of p micro-batches (its steady
state: the busiest rank, or the interleaved order's longest dependency cycle), which the difference measures.
"""
import functools

from tp.pipeline.schedules import build, simulate


@functools.lru_cache(maxsize=4096)
def _simulated(schedule, pp, virtual_stages, micro_batches, stage_costs):
    return simulate(build(schedule, pp, micro_batches, virtual_stages), stage_costs=stage_costs).span


def span(schedule, pp, virtual_stages, micro_batches, stage_costs):
    """Seconds from the first forward to the last backward of `micro_batches` through the pipeline; `stage_costs`:
    (F, B, W) seconds of one micro-batch through each virtual stage s = c·pp + r (module docstring)."""
    costs = tuple(tuple(float(x) for x in c) for c in stage_costs)
    if micro_batches <= 2 * pp:
        return _simulated(schedule, pp, virtual_stages, micro_batches, costs)
    low, high = (_simulated(schedule, pp, virtual_stages, m, costs) for m in (pp, 2 * pp))
    return high + (micro_batches - 2 * pp) * (high - low) / pp
