"""`Family`: what the package knows of one Hugging Face model family. A family is an instance of a subclass, declared
in the family's own module (tp/hf/llama.py, ...) and named once, there; tp/hf/registry.py lists the instances."""
from typing import Any

from torch import nn

# transformers 5's in-memory names of the tensors behind the GPT's mixture-of-experts and q/k-norm parameters, the
# same in every family that has them: our parameter (after `layers.<i>.`) -> the tensors (after the HF layer's
# prefix) it concatenates
MOE_TENSORS = {"mlp.router.weight": ("mlp.gate.weight",), "mlp.experts.fc1": ("mlp.experts.gate_up_proj",),
               "mlp.experts.fc2": ("mlp.experts.down_proj",),
               "mlp.shared.fc1.weight": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
               "mlp.shared.fc2.weight": ("mlp.shared_expert.down_proj.weight",),
               "mlp.shared.gate": ("mlp.shared_expert_gate.weight",),
               "attention.q_norm.weight": ("self_attn.q_norm.weight",),
               "attention.k_norm.weight": ("self_attn.k_norm.weight",)}


# multi-token prediction's modules (after `mtp.<k>.`) -> their names in DeepSeek-V3's published checkpoints, under
# the layer after the model's last (`model.layers.<num_layers + k>.`), its block's tensors named as a layer's
MTP_MODULES = {"embedding_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj", "final_norm": "shared_head.norm"}


def unmet(config: Any, label: str, checks: list[tuple[bool, str, str]]) -> list[str]:
    """'field=value (label: what the family has)' for every (holds, field, what the family has) that does not hold."""
    return [f"{field}={getattr(config, field)!r} ({label}: {has})" for holds, field, has in checks if not holds]


class LocalHeadsConfig:
    """An attention module's view of the shared model config with this rank's head counts; the rest reads through
    (so later changes to the model's config, e.g. its attention implementation, still reach the module)."""

    def __init__(self, config: Any, **local: int) -> None:
        self.__dict__.update(local, _config=config)

    def __getattr__(self, name):
        config = self.__dict__.get("_config")
        if config is None:  # during copy/unpickling, before __dict__ is restored
            raise AttributeError(name)
        return getattr(config, name)

    def __repr__(self):
        local = {k: v for k, v in self.__dict__.items() if k != "_config"}
        return f"LocalHeadsConfig({type(self._config).__name__}, {local})"


class Family:
    """One Hugging Face family, `config.model_type` = `name`. The class attributes are the defaults: Llama's
    attention under the config's own tensor-parallel plan, not read or written by models.GPT.

    tp.parallelize reads the first group (the transformers model's modules). models.hf reads the rest, in the
    families whose `config_class` is set: the GPT's config and parameters as this family's config and tensors, in
    the GPT's field and parameter names (plain strings: tp never imports models)."""

    # tp.parallelize of the transformers model
    plan: dict[str, str] | None = None  # shipped plan relative to the base model; None: config.base_model_tp_plan
    plan_additions: dict[str, str] = {}  # entries the config's plan lacks (patterns may match nothing)
    heads = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv"}  # leaf name of an attention projection -> its heads
    out = "o_proj"  # the attention's output projection (rowwise when its heads are local)
    fused_mlp: dict[str, int] = {}  # leaf name -> stride of a fused [gate; up] weight
    replicate_kv = True  # whether the attention code takes kv heads replicated across ranks
    # the config field giving the width of the output tail a "replicated_with_tail_grad_allreduce" layer feeds to
    # every head (HF's mla_kv_a_proj, the same name in every family with multi-head latent attention: the RoPE key)
    shared_tail_field = "qk_rope_head_dim"
    checked = True  # read against the family's attention code and covered by the tests

    # models.hf: the GPT <-> this family's config and tensors
    config_class: str | None = None  # the transformers config class the GPT is saved with; None: tp.parallelize only
    title = ""  # the family in messages
    root = "model"  # tensor names: root.embedding, root.layers.<i>.<layer tensor>, root.final_norm, output
    embedding = "embed_tokens"
    position_embedding = "wpe"  # learned positions (GPT-2's name: checkpoints of another family's config with
    # learned positions name them so too)
    layers = "layers"
    final_norm = "norm"
    output = "lm_head"
    layer_modules: dict[str, tuple[str, ...]] = {}  # our layer module -> the HF modules (.weight/.bias) it fuses
    layer_tensors = MOE_TENSORS  # our layer parameter -> the HF tensors it fuses (before layer_modules)
    conv1d = False  # linear weights stored [in, out] (transformers' Conv1D)
    experts_on_disk = ("mlp", "gate_proj", "up_proj", "down_proj")  # per-expert names transformers writes

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def head_width(self, attention: nn.Module, leaf: str) -> int | None:
        """Each head's width in the output of the projection `leaf` of `attention` (None: unknown)."""
        return getattr(attention, "head_dim", None)

    def localize(self, attention: nn.Module, heads: int, kv_heads: int) -> None:
        """Give an attention module whose heads are split its local head counts (where it caches them)."""
        attention.num_key_value_groups = heads // kv_heads  # what repeat_kv / SDPA GQA read

    def config_fields(self, hf: Any) -> dict[str, Any]:
        """GPTConfig fields of a transformers config of this family (RoPE's: models.hf's, the same in every family).
        Raises a ValueError naming a setting the GPT does not have."""
        raise NotImplementedError(f"{self.name}: models.GPT does not read this family")

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        """The keyword arguments of `config_class` for a GPTConfig that fits (no problems)."""
        raise NotImplementedError(f"{self.name}: models.GPT does not write this family")

    def dense_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        """(holds, field, what the family has) for the GPTConfig fields of the attention and MLP."""
        raise NotImplementedError(f"{self.name}: models.GPT does not write this family")

    def moe_checks(self, config: Any) -> list[tuple[bool, str, str]]:
        """The same for the mixture-of-experts fields (and q/k norms): a dense family has neither."""
        c = config
        return [(not c.num_experts, "num_experts", "no experts"), (c.qk_norm is None, "qk_norm", "no q/k norms")]

    def problems(self, config: Any) -> list[str]:
        """'field=value (what the family has)' for every field of a GPTConfig the family cannot represent."""
        return unmet(config, self.title, self.dense_checks(config)) + unmet(config, self.name, self.moe_checks(config))
