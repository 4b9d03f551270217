"""Why a --fix leaves no plan: the first constraint the pinned values break (bench.plan.search's rules), as one line."""
from .search import stage_split
from .stages import ACCOUNTED, EVEN, layer_counts


def _degree_conflict(config, gpus, seq_len, global_batch_size, fixed):
    tp, cp, pp = fixed.get("tp", 1), fixed.get("cp", 1), fixed.get("pp", 1)
    for name in ("tp", "cp", "pp", "dp"):
        if name in fixed and gpus % fixed[name]:
            return f"{name}={fixed[name]} does not divide the {gpus} GPUs"
    if "tp" in fixed:
        try:
            config.check_tp(tp)
        except ValueError as e:
            return str(e)
    if cp > 1 and seq_len % (2 * cp):
        return f"cp={cp} needs the sequence ({seq_len}) divisible by 2·cp = {2 * cp}"
    if pp > config.num_layers:
        return f"pp={pp} stages need at least {pp} layers, the model has {config.num_layers}"
    product = tp * cp * pp * fixed.get("dp", 1)
    if gpus % product or (all(k in fixed for k in ("tp", "cp", "pp", "dp")) and product != gpus):
        return f"tp·cp·pp·dp = {product} does not make the {gpus} GPUs"
    return None


def _batch_conflict(config, gpus, seq_len, global_batch_size, fixed):
    dp = fixed.get("dp")
    if dp is None and all(k in fixed for k in ("tp", "cp", "pp")):
        dp = gpus // (fixed["tp"] * fixed["cp"] * fixed["pp"])
    if dp and global_batch_size % dp:
        return f"dp={dp} does not divide the global batch of {global_batch_size}"
    if dp and "mbs" in fixed and (global_batch_size // dp) % fixed["mbs"]:
        return f"mbs={fixed['mbs']} does not divide the {global_batch_size // dp} sequences per dp rank"
    tp = fixed.get("tp", 1)
    if fixed.get("sp") == "on":
        if "tp" in fixed and tp == 1:
            return "sp=on needs tp > 1"
        shards = tp * (2 * fixed["cp"] if fixed.get("cp", 1) > 1 else 1)
        if seq_len % shards:
            return f"sp=on needs the sequence ({seq_len}) divisible by {shards}"
    return None


def _split_conflict(config, pp, vp, splits):
    """Why none of `splits` divides the layers over pp·vp stages (each split's reason), or None."""
    reasons = []
    for split in splits:
        try:
            layer_counts(config.num_layers, pp, vp, split)
            return None
        except ValueError as e:
            reasons.append(str(e) if split.even or len(splits) == 1 else f"with the {split.label()} accounted: {e}")
    return "; ".join(reasons)


def _pipeline_conflict(config, gpus, seq_len, global_batch_size, fixed):
    split = stage_split(fixed)
    vp = fixed.get("vp", 1)
    if "pp" not in fixed:  # (some pp may still fit them)
        return None
    pp = fixed["pp"]
    if vp > 1 and pp == 1:
        return f"vp={vp} interleaves pipeline stages: it needs pp > 1"
    conflict = _split_conflict(config, pp, vp, [split] if split else [EVEN, ACCOUNTED])
    if conflict:
        return conflict
    dp = fixed.get("dp") or (gpus // (fixed["tp"] * fixed["cp"] * pp) if "tp" in fixed and "cp" in fixed else None)
    if vp > 1 and dp and global_batch_size % dp == 0:
        per_rank = global_batch_size // dp
        if "mbs" in fixed and per_rank % fixed["mbs"] == 0 and (per_rank // fixed["mbs"]) % pp:
            return f"vp={vp}: the {per_rank // fixed['mbs']} micro-batches are not a multiple of pp={pp} (interleaving)"
        if not any(per_rank % mbs == 0 and (per_rank // mbs) % pp == 0 for mbs in range(1, per_rank + 1)):
            return (f"vp={vp}: no micro-batch size makes the {per_rank} sequences per dp rank a multiple of pp={pp} "
                    "micro-batches (interleaving)")
    return None


def _expert_conflict(config, gpus, seq_len, global_batch_size, fixed):
    ep, etp = fixed.get("ep", 1), fixed.get("etp")
    if not config.num_experts:
        return f"ep={ep} splits experts and the model has none" if ep > 1 else None
    if config.num_experts % ep:
        return f"ep={ep} does not divide the {config.num_experts} experts"
    if etp and config.moe_ffn_hidden_size % etp:
        return f"etp={etp} does not divide the experts' FFN ({config.moe_ffn_hidden_size})"
    if all(k in fixed for k in ("tp", "cp", "pp")):
        ranks = gpus // fixed["pp"]
        if ranks % (ep * (etp or fixed["tp"])):
            return f"ep·etp = {ep * (etp or fixed['tp'])} does not divide the {ranks} ranks of a stage (tp·cp·dp)"
    return None


def fix_conflict(config, *, gpus, seq_len, global_batch_size, fixed):
    """The first constraint the --fix values break (one line), or None when no single one is to blame."""
    for check in (_degree_conflict, _batch_conflict, _pipeline_conflict, _expert_conflict):
        conflict = check(config, gpus, seq_len, global_batch_size, fixed)
        if conflict:
            return conflict
    return None
