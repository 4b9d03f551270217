"""Splitting a Hugging Face model's attention heads over tp, per its family's `heads`, `out`, `fused_mlp` and
`replicate_kv`.

Sharding attention projections column-wise leaves each rank a contiguous block of heads. HF attention reshapes with
-1 heads, so the local count follows, except where a module caches a count (`Family.localize` sets it). Where kv
heads < tp (and tp is a multiple of them), each kv head is held by tp / kv ranks (`part_replicas`): the checked
families feed their kv heads through HF's `repeat_kv(num_key_value_groups)` (or SDPA's GQA), which takes the local
ratio.
"""
from torch import nn

from .family import Family

COLUMN_STYLES = ("colwise", "colwise_gather_output")


def out_features(module: nn.Module) -> int:
    """A linear layer's output width (HF's Conv1D calls it nf)."""
    return module.nf if hasattr(module, "nf") else module.out_features


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _head_counts(config, attention, name, width):
    text = _text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads is None or width is None:
        raise ValueError(f"{name}: cannot read the head counts (config.num_attention_heads, {name}.head_dim) to "
                         "split its heads")
    return heads, kv_heads, width


def shared_tail_width(module: nn.Module, layer: nn.Module, family: Family | None, name: str) -> int:
    """The width of the output tail that `layer` (`name`, style replicated_with_tail_grad_allreduce) feeds to every
    head: the family's `shared_tail_field` of the model's config, narrower than the layer's output."""
    field = family.shared_tail_field if family is not None else Family.shared_tail_field
    width = getattr(_text_config(getattr(module, "config", None)), field, None)
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"{name}: replicated_with_tail_grad_allreduce sums the gradient of the output's last "
                         f"config.{field} features, and {type(module).__name__} has no config.{field}")
    if width >= out_features(layer):
        raise ValueError(f"{name}: config.{field} = {width} is not narrower than its output ({out_features(layer)} "
                         "features): replicated_with_tail_grad_allreduce sums the gradient of the last ones only")
    return width


def _kv_replicas(heads, kv_heads, tp_size, family, name):
    """How many ranks hold each kv head: 1 when they split evenly, tp / kv_heads when the family allows it."""
    if heads % tp_size:
        raise ValueError(f"{name}: num_attention_heads = {heads} is not divisible by tp = {tp_size}")
    if kv_heads % tp_size == 0:
        return 1
    if tp_size % kv_heads or not family.replicate_kv:
        why = ("is neither divisible by tp nor a divisor of it" if tp_size % kv_heads else
               "< tp and replicating kv heads is not verified for this family's attention code")
        raise ValueError(f"{name}: num_key_value_heads = {kv_heads} {why} (tp = {tp_size})")
    return tp_size // kv_heads


def shard_options(module: nn.Module, modules: dict[str, nn.Module], styles: dict[str, str], family: Family | None,
                  tp_size: int) -> tuple[dict[str, dict], dict[str, tuple[int, int, int]]]:
    """Layer options per sharded module (fused parts, replicated kv chunks) and {attention name: (local heads,
    local kv heads, kv replicas)} for the attention modules whose heads become local. Raises before any change."""
    options, local_heads = {}, {}
    if family is None:
        return options, local_heads
    for name, style in styles.items():
        parent, _, leaf = name.rpartition(".")
        if style in COLUMN_STYLES and leaf in family.fused_mlp:
            options[name] = {"stride": family.fused_mlp[leaf]}
        kind = family.heads.get(leaf)
        if kind is None or style not in COLUMN_STYLES:
            continue
        heads, kv_heads, head_dim = _head_counts(module.config, modules[parent], parent,
                                                 family.head_width(modules[parent], leaf))
        expected = {"q": heads, "kv": kv_heads, "qkv": heads + 2 * kv_heads}[kind] * head_dim
        if out_features(modules[name]) != expected:
            raise ValueError(f"{name}: out_features = {out_features(modules[name])}, expected {expected} from the "
                             "config's head counts (per-layer head counts are not supported)")
        if style == "colwise_gather_output":  # every rank gets all heads back: only the fused order matters
            if kind == "qkv":
                options[name] = {"parts": (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)}
            continue
        _check_attention_split(parent, modules, styles, family)
        replicas = _kv_replicas(heads, kv_heads, tp_size, family, parent)
        local_heads[parent] = (heads // tp_size, kv_heads * replicas // tp_size, replicas)
        if kind == "kv" and replicas > 1:
            options[name] = {"part_replicas": (replicas,)}
        elif kind == "qkv":
            parts = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
            options[name] = {"parts": parts} | ({"part_replicas": (1, replicas, replicas)} if replicas > 1 else {})
    return options, local_heads


def _check_attention_split(attention, modules, styles, family):
    """Local heads need every head projection of the attention column-local and its output projection rowwise."""
    for leaf in (*family.heads, family.out):
        name = f"{attention}.{leaf}"
        wanted = "rowwise" if leaf == family.out else "colwise"
        if name in modules and styles.get(name) != wanted:
            now = repr(styles[name]) if name in styles else "not sharded"
            raise ValueError(f"{name} is {now} but must be {wanted!r}: the heads of {attention} are split across ranks")
