"""The experts of transformers' mixtures of experts in both of its layouts: fused in memory
(`…mlp.experts.gate_up_proj` [E, 2F, h], `…down_proj` [E, h, F]) and per expert on disk, as the family's
`experts_on_disk` names them (tp/hf/moe.py); each rank reads only its experts."""
from typing import Any

import torch

import tp.hf


def expert_names(fused: str, expert: int, family: str) -> list[str]:
    """The per-expert tensors on disk behind one expert of the in-memory fused tensor `fused` (…mlp.experts.
    gate_up_proj: [gate, up]; …down_proj: [down]), e.g. Mixtral's `model.layers.0.block_sparse_moe.experts.3.w1.weight`
    (and w3) for expert 3 of gate_up_proj."""
    module, gate, up, down = tp.hf.FAMILIES[family].experts_on_disk
    base = f"{fused.rsplit('.mlp.experts.', 1)[0]}.{module}.experts.{expert}"
    parts = (gate, up) if fused.endswith("gate_up_proj") else (down,)
    return [f"{base}.{part}.weight" for part in parts]


def disk_name(name: str, family: str) -> str:
    """The on-disk name of an in-memory HF tensor name (Mixtral's router lives in block_sparse_moe)."""
    module = tp.hf.FAMILIES[family].experts_on_disk[0]
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
