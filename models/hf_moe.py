"""Hugging Face's mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) for models.hf: their config
fields, their tensor names, and the experts read and written in both of transformers' layouts.

transformers 5 holds each layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2F, h], gate rows first,
and `mlp.experts.down_proj` [E, h, F], the router at `mlp.gate.weight` [E, h]) and writes them to disk per expert, as
the published checkpoints hold them (Mixtral: `block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2` down and
`block_sparse_moe.gate`; the others: `mlp.experts.{e}.{gate,up,down}_proj`). Loading reads either layout, each rank
only its experts; saving writes the per-expert one (which transformers 4 reads too).
"""
from typing import Any

import torch

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_LEGACY = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}  # family -> (module, gate, up, down) on disk
_DEFAULT_LEGACY = ("mlp", "gate_proj", "up_proj", "down_proj")


def moe_fields(hf: Any) -> dict[str, Any]:
    """GPTConfig fields of an HF MoE config (attention fields are models.hf's)."""
    family = hf.model_type
    if getattr(hf, "router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise={hf.router_jitter_noise} is not supported (0: none)")
    if getattr(hf, "clip_qkv", None) is not None:
        raise ValueError(f"clip_qkv={hf.clip_qkv} is not supported (None: no clipping)")
    experts = hf.num_local_experts if family == "mixtral" else hf.num_experts
    fields = dict(num_experts=experts, moe_router_topk=hf.num_experts_per_tok,
                  moe_router_norm_topk=family == "mixtral" or bool(hf.norm_topk_prob))
    if family in ("qwen2_moe", "qwen3_moe"):
        step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or [])
        fields.update(moe_ffn_hidden_size=hf.moe_intermediate_size, moe_layer_freq=[
            int(i not in dense and (i + 1) % step == 0) for i in range(hf.num_hidden_layers)])
        if fields["moe_layer_freq"] == [1] * hf.num_hidden_layers:
            fields["moe_layer_freq"] = 1
    else:
        fields.update(moe_ffn_hidden_size=hf.intermediate_size)
    if family == "qwen2_moe":
        fields.update(moe_shared_expert_size=hf.shared_expert_intermediate_size, moe_shared_expert_gate=True)
    fields["qk_norm"] = {"qwen3_moe": "head", "olmoe": "full"}.get(family)
    return fields


def moe_problems(config: Any, family: str) -> list[str]:
    """'field=value (what the family has)' for every MoE field `family` cannot represent."""
    c, problems = config, []

    def need(ok, field, has):
        if not ok:
            problems.append(f"{field}={getattr(c, field)!r} ({family}: {has})")

    if family not in MOE_FAMILIES:
        need(not c.num_experts, "num_experts", "no experts")
        need(c.qk_norm is None, "qk_norm", "no q/k norms")
        return problems
    need(c.num_experts > 0, "num_experts", "a mixture of experts")
    need(c.moe_router_score == "softmax", "moe_router_score", "softmax routing")
    need(c.moe_router_norm_topk or family != "mixtral", "moe_router_norm_topk", "the top-k weights renormalised")
    need(c.qk_norm == {"qwen3_moe": "head", "olmoe": "full"}.get(family), "qk_norm",
         {"qwen3_moe": "'head'", "olmoe": "'full'"}.get(family, "none"))
    every = c.moe_layer_freq == 1 or c.moe_layer_freq == [1] * c.num_layers
    need(every or family in ("qwen2_moe", "qwen3_moe"), "moe_layer_freq", "experts in every layer")
    shared = family == "qwen2_moe"
    need(bool(c.moe_shared_expert_size) == shared, "moe_shared_expert_size",
         "a shared expert" if shared else "no shared expert")
    need(c.moe_shared_expert_gate == shared, "moe_shared_expert_gate", "its sigmoid gate" if shared else "none")
    return problems


def moe_config_kwargs(config: Any, family: str) -> dict[str, Any]:
    """The HF config's MoE fields (the attention and sizes are models.hf's)."""
    c = config
    if family == "mixtral":
        return dict(num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                    router_aux_loss_coef=c.moe_aux_loss_coeff)
    kwargs = dict(num_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                  norm_topk_prob=c.moe_router_norm_topk, router_aux_loss_coef=c.moe_aux_loss_coeff)
    if family in ("qwen2_moe", "qwen3_moe"):
        pattern = [int(c.is_moe_layer(i)) for i in range(c.num_layers)]
        kwargs.update(moe_intermediate_size=c.moe_ffn_hidden_size, decoder_sparse_step=1,
                      mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    if family == "qwen2_moe":
        kwargs.update(shared_expert_intermediate_size=c.moe_shared_expert_size)
    return kwargs


def moe_sources(name: str, block: str) -> list[tuple[str, bool]] | None:
    """The HF tensors (in-memory names) behind an MoE or q/k-norm parameter of ours (`layers.<i>.` + name), or None."""
    local = {"mlp.router.weight": ["mlp.gate.weight"], "mlp.experts.fc1": ["mlp.experts.gate_up_proj"],
             "mlp.experts.fc2": ["mlp.experts.down_proj"],
             "mlp.shared.fc1.weight": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"],
             "mlp.shared.fc2.weight": ["mlp.shared_expert.down_proj.weight"],
             "mlp.shared.gate": ["mlp.shared_expert_gate.weight"],
             "attention.q_norm.weight": ["self_attn.q_norm.weight"],
             "attention.k_norm.weight": ["self_attn.k_norm.weight"]}.get(name)
    return None if local is None else [(f"{block}.{part}", False) for part in local]


def _legacy(family):
    return _LEGACY.get(family, _DEFAULT_LEGACY)


def expert_names(fused: str, expert: int, family: str) -> list[str]:
    """The per-expert tensors on disk behind one expert of the in-memory fused tensor `fused` (…mlp.experts.
    gate_up_proj: [gate, up]; …down_proj: [down]), e.g. Mixtral's `model.layers.0.block_sparse_moe.experts.3.w1.weight`
    (and w3) for expert 3 of gate_up_proj."""
    module, gate, up, down = _legacy(family)
    base = f"{fused.rsplit('.mlp.experts.', 1)[0]}.{module}.experts.{expert}"
    parts = (gate, up) if fused.endswith("gate_up_proj") else (down,)
    return [f"{base}.{part}.weight" for part in parts]


def disk_name(name: str, family: str) -> str:
    """The on-disk name of an in-memory HF tensor name (Mixtral's router lives in block_sparse_moe)."""
    module = _legacy(family)[0]
    return name.replace(".mlp.gate.weight", f".{module}.gate.weight") if module != "mlp" else name


def read_experts(reader: Any, fused: str, experts: range, family: str) -> torch.Tensor:
    """[len(experts), rows, cols] of the fused tensor `fused` (…mlp.experts.gate_up_proj / down_proj): read from it
    when the reader holds it, else from the per-expert tensors on disk."""
    if reader.has(fused):
        return reader.read(fused, 0, experts.start, experts.stop)
    return torch.stack([torch.cat([reader.read(n) for n in expert_names(fused, e, family)]) for e in experts])


def to_disk(tensors: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """In-memory HF tensors -> the per-expert layout transformers writes (others unchanged, Mixtral's router
    renamed)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            for e, expert in enumerate(t):
                names = expert_names(name, e, family)
                for n, piece in zip(names, expert.chunk(len(names))):
                    out[n] = piece.contiguous()
        else:
            out[disk_name(name, family)] = t
    return out
