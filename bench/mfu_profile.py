"""bench.mfu's time breakdown: one step under torch.profiler, each op's time (on CUDA its kernels', elsewhere its
self CPU time) put in a category by its name and its enclosing ops' names."""
import re

import torch

# (category, pattern on the profiler's op names: an op's own and its enclosing ones'), in order: an op inside the
# optimizer's or the loss's region counts there, then the first name from the op outwards that matches attention,
# GEMM or norm; the rest is "elementwise" (activations, residual adds, copies, casts, collectives on one rank)
REGIONS = (("optimizer", r"optimizer|adam|clip_grad|_foreach_norm"),
           ("loss", r"cross_?entropy|vocab_|nll_loss|log_softmax"),
           ("attention", r"attention|flash|fmha|sdpa"))
OPS = (("gemm", r"\b(aten::)?(mm|addmm|bmm|matmul|linear|_grouped_mm|_scaled_mm)\b|gemm|LinearFunction|"
                r"GroupedLinear|nvjet|cutlass|xmma|_linear_\w*kernel"),
       ("norm", r"norm"))
BREAKDOWN = ("gemm", "attention", "norm", "elementwise", "loss", "optimizer", "idle")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def category(names: list[str]) -> str:
    """The category of an op from its name and its enclosing ops' (nearest first)."""
    for kind, pattern in REGIONS:
        if any(re.search(pattern, n, re.I) for n in names):
            return kind
    for name in names:
        for kind, pattern in OPS:
            if re.search(pattern, name, re.I):
                return kind
    return "elementwise"


def _names(event):
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def breakdown(run_step, device, step_s: float) -> dict:
    """Seconds of one step per category from torch.profiler: on CUDA the device time of the kernels each op
    launched, elsewhere each op's self CPU time; idle: the step's wall time not covered (CPU: Python, the
    interpreter's overhead; CUDA: the device waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_step()
        sync(device)
    events = prof.events()
    seconds = op_seconds(events, cuda)
    if cuda:  # kernels no op claimed (a profiler that does not link them): by their own names
        kernels_s = [(e.name, e.time_range.elapsed_us() * 1e-6) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
        unclaimed = sum(s for _, s in kernels_s) - sum(seconds.values())
        if unclaimed > 0.05 * step_s:
            seconds = dict.fromkeys(BREAKDOWN, 0.0)
            for name, busy in kernels_s:
                seconds[category([name])] += busy
    seconds["idle"] = max(0.0, step_s - sum(seconds.values()))
    return {k: round(v, 5) for k, v in seconds.items()}


def op_seconds(events, cuda: bool) -> dict[str, float]:
    """Seconds per category from the profiler's CPU-side events: on CUDA the kernels each op launched, elsewhere each
    op's self CPU time. A region of record_function (a user annotation: the optimizer's step, clipping) is not an op:
    on CUDA the profiler links it to its own span on the device, which would count its ops' kernels a second time."""
    seconds = dict.fromkeys(BREAKDOWN, 0.0)
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.is_user_annotation:
            continue
        busy = sum(k.duration for k in event.kernels) if cuda else event.self_cpu_time_total
        if busy > 0 and (cuda or "::" in event.name):  # (CPU: ops, not the Python-level regions around them)
            seconds[category(_names(event))] += busy * 1e-6
    return seconds
