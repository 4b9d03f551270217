"""Activation recomputation (`GPTConfig.recompute`, the job's --recompute; Megatron's --recompute-granularity): which
parts of each transformer block drop their activations in forward and recompute them in backward. models/block.py
checkpoints the parts; GRANULARITIES is the one list of granularities (GPTConfig, the job and the planner read it).

Parts: "core", the attention core (softmax(QKᵀ)V from the kept q, k, v: Korthikanti et al. 2022's selective
recomputation, arXiv:2205.05198 §5); "block", the whole block from its input.
"""

# granularity -> the parts of a block it recomputes
GRANULARITIES = {"none": frozenset(), "selective": frozenset({"core"}), "full": frozenset({"block"})}


def recomputes(granularity: str, part: str) -> bool:
    """Whether `granularity` (a GRANULARITIES name) recomputes `part` ("core" or "block") of every block."""
    return part in GRANULARITIES[granularity]
