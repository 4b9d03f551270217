"""What `tp.parallelize` knows about model families: default plans, fused layouts and attention head counts.

A plan maps module-name patterns to styles. A Hugging Face model's default is its own `config.base_model_tp_plan`
(prefixed with `base_model_prefix`), except where this file ships a better one: Phi3 (HF gathers the fused qkv and
gate/up outputs on every rank; here they stay local shards) and GPT-2 (HF ships none).

Sharding attention projections column-wise leaves each rank a contiguous block of heads. HF attention reshapes
with -1 heads, so the local count follows, except where a module caches a count: `FAMILIES` says, per checked
family, which projections carry heads and how to set the attention module's local counts. Where kv heads < tp (and
tp is a multiple of them), each kv head is held by tp / kv ranks (`part_replicas`): the families listed here feed
their kv heads through HF's `repeat_kv(num_key_value_groups)` (or SDPA's GQA), which takes the local ratio.
"""
import dataclasses

from torch import nn

COLUMN_STYLES = ("colwise", "colwise_gather_output")
EXPERTS_STYLES = ("moe_experts", "moe_tp_experts", "ep_dispatch_experts")  # (HF's names read as moe_experts)

PHI3_PLAN = {  # relative to the base model; HF's own gathers qkv/gate_up ("colwise_gather_output")
    "layers.*.self_attn.qkv_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
GPT2_PLAN = {
    "h.*.attn.c_attn": "colwise",
    "h.*.attn.c_proj": "rowwise",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}


class LocalHeadsConfig:
    """An attention module's view of the shared model config with this rank's head counts; the rest reads through
    (so later changes to the model's config, e.g. its attention implementation, still reach the module)."""

    def __init__(self, config, **local):
        self.__dict__.update(local, _config=config)

    def __getattr__(self, name):
        config = self.__dict__.get("_config")
        if config is None:  # during copy/unpickling, before __dict__ is restored
            raise AttributeError(name)
        return getattr(config, name)

    def __repr__(self):
        local = {k: v for k, v in self.__dict__.items() if k != "_config"}
        return f"LocalHeadsConfig({type(self._config).__name__}, {local})"


def _set_kv_groups(attention, heads, kv_heads):
    attention.num_key_value_groups = heads // kv_heads  # what repeat_kv / SDPA GQA read


def _phi3_heads(attention, heads, kv_heads):
    _set_kv_groups(attention, heads, kv_heads)
    attention.num_key_value_heads = kv_heads  # slices the fused qkv output
    attention.config = LocalHeadsConfig(attention.config, num_attention_heads=heads, num_key_value_heads=kv_heads)


def _gpt2_heads(attention, heads, kv_heads):
    attention.num_heads, attention.split_size = heads, heads * attention.head_dim  # c_attn's output splits by it


@dataclasses.dataclass(frozen=True)
class Family:
    plan: dict = None  # shipped plan relative to the base model; None: the config's base_model_tp_plan
    heads: dict = dataclasses.field(  # leaf name of an attention projection -> the heads it carries
        default_factory=lambda: {"q_proj": "q", "k_proj": "kv", "v_proj": "kv"})
    out: str = "o_proj"  # the attention's output projection (rowwise when its heads are local)
    fused_mlp: dict = dataclasses.field(default_factory=dict)  # leaf name -> stride of a fused [gate; up] weight
    localize: object = _set_kv_groups  # (attention, local heads, local kv heads) -> None
    replicate_kv: bool = True  # whether the attention code takes kv heads replicated across ranks
    checked: bool = True  # read against the family's attention code and covered by the tests


_LLAMA_LIKE = Family()
FAMILIES = dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"), _LLAMA_LIKE)
# mixtures of experts: Llama-like attention (OLMoE's plan gathers q/k/v for its whole-projection norms), the experts
# module on tp.moe.ParallelExperts (HF's moe_tp_experts / ep_dispatch_experts)
FAMILIES.update(dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"), _LLAMA_LIKE))
FAMILIES["phi3"] = Family(plan=PHI3_PLAN, heads={"qkv_proj": "qkv"}, fused_mlp={"gate_up_proj": 2},
                          localize=_phi3_heads)
FAMILIES["gpt2"] = Family(plan=GPT2_PLAN, heads={"c_attn": "qkv"}, out="c_proj", localize=_gpt2_heads,
                          replicate_kv=False)
# Any other family: HF's plan with HF's semantics; heads checked where the names say so, never replicated.
UNCHECKED = Family(localize=None, replicate_kv=False, checked=False)


def model_type(module: nn.Module) -> str | None:
    """A Hugging Face model's config.model_type, else None."""
    return getattr(getattr(module, "config", None), "model_type", None)


def family_of(module: nn.Module) -> Family | None:
    """The family entry for a Hugging Face model, UNCHECKED for other HF families, None for a plain module."""
    if model_type(module) is None:
        return None
    return FAMILIES.get(model_type(module), UNCHECKED)


def _base_plan(module):
    family, config = family_of(module), getattr(module, "config", None)
    if family is not None and family.plan is not None:
        return family.plan, f"tp's plan for {model_type(module)}"
    return _config_plan(config), f"{type(config).__name__}.base_model_tp_plan"


def _config_plan(config):
    """The config's tensor-parallel plan, the same on transformers 5.17 and 5.24:
    - 5.17 (not 5.24) adds "embed_tokens": "embedding_rowwise" to a tied-embedding config's plan at init (its loader
      then also shards lm_head by the model's _tp_plan): the embedding alone sharded would break the tie, so tp's
      default keeps both whole, as the class declares its plan;
    - 5.17 names some families' fused experts only in base_model_ep_plan (Qwen2-MoE): taken from there."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return plan
    if "embed_tokens" in plan and "embed_tokens" not in (getattr(type(config), "base_model_tp_plan", None) or {}):
        plan = {pattern: style for pattern, style in plan.items() if pattern != "embed_tokens"}
    if not any(style in EXPERTS_STYLES for style in plan.values()):
        ep_plan = getattr(config, "base_model_ep_plan", None) or {}
        plan = plan | {pattern: style for pattern, style in ep_plan.items() if style in EXPERTS_STYLES}
    return plan


def default_plan(module: nn.Module) -> dict[str, str]:
    """The plan `tp.parallelize(module)` applies (full module-name patterns -> styles), a dict to extend:
    `tp.parallelize(model, {**tp.default_plan(model), "model.embed_tokens": "vocab", "lm_head": "colwise"})`."""
    base, _ = _base_plan(module)
    if not base:
        raise ValueError(f"{type(module).__name__} has no tensor-parallel plan (no config.base_model_tp_plan, "
                         f"and tp ships none for model_type {model_type(module)!r}): pass plan=")
    base_model = getattr(module, "base_model", module)
    prefix = "" if base_model is module else f"{module.base_model_prefix}."
    return {prefix + pattern: style for pattern, style in base.items()}


def plan_source(module: nn.Module) -> str:
    """Where the default plan comes from, for `tp.describe`."""
    return _base_plan(module)[1]


def out_features(module: nn.Module) -> int:
    """A linear layer's output width (HF's Conv1D calls it nf)."""
    return module.nf if hasattr(module, "nf") else module.out_features


def _head_counts(config, attention, name):
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(attention, "head_dim", None)
    if heads is None or head_dim is None:
        raise ValueError(f"{name}: cannot read the head counts (config.num_attention_heads, {name}.head_dim) to "
                         "split its heads")
    return heads, kv_heads, head_dim


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


def shard_options(module, modules, styles, family, tp_size):
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
        heads, kv_heads, head_dim = _head_counts(module.config, modules[parent], parent)
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
