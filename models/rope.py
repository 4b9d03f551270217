"""Rotary position embeddings (RoPE) as Hugging Face computes them: the inverse frequencies (plain, "linear", "llama3"
and "yarn" scaling), the cos/sin tables, the rotation of [b, n, s, d] heads, and `rotary`, which applies it to the
part of each head a model rotates (GLM-4.5's first half, DeepSeek's interleaved pairs)."""
import functools
import math
from typing import Any

import torch

import kernels.ops

YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}  # Hugging Face's (and the YaRN paper's)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·mscale·ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What the cos/sin tables are multiplied by (Hugging Face's `attention_scaling`): 1, except under YaRN its
    attention_factor, or mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given (DeepSeek-V3: 1),
    else mscale(factor)."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor"):
        return float(scaling["attention_factor"])
    factor, mscale, all_dims = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dims:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims)
    return yarn_mscale(factor)


def _yarn_frequencies(inv_freq, head_dim, theta, scaling, device):
    """YaRN (Peng et al. 2023, arXiv:2309.00071) as Hugging Face's _compute_yarn_parameters: dimensions rotating
    more than beta_fast times over the original context keep their frequency, fewer than beta_slow times are
    divided by `factor`, a linear ramp between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or YARN_DEFAULTS["beta_fast"]
    beta_slow = scaling.get("beta_slow") or YARN_DEFAULTS["beta_slow"]

    def dimension(rotations):  # the dimension that rotates `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dimension(beta_fast)), 0), min(math.ceil(dimension(beta_slow)), head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = (1 - ramp).to(inv_freq.device)
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    return 1.0 / (factor * base) * (1 - extrapolation) + inv_freq * extrapolation


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """inv_freq [d/2] in fp32, HF's: θ^(−2i/d), divided by `factor` ("linear") or, "llama3" (Llama 3.1+), by `factor`
    for wavelengths beyond original_max_position_embeddings / low_freq_factor, kept below
    original / high_freq_factor, and interpolated smoothly between; "yarn": _yarn_frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling, device)
    if kind != "default":  # (GPTConfig validates rope_scaling)
        raise ValueError(f"rope_type={kind!r} is not supported")
    return inv_freq


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(head_dim, theta, scaling, device):
    return rope_frequencies(head_dim, theta, dict(scaling) if scaling else None, device)


def _rope_angles(positions, inv_freq, dtype, factor):
    """cos and sin [..., d] at `positions` [...] (fp32 products, HF's way), times `factor` (YaRN's)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., d/2]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


@functools.lru_cache(maxsize=16)
def _rope_tables(seq, head_dim, theta, scaling, device, dtype):
    """cos and sin [s, d], once per shape: every layer and step reuses them."""
    inv_freq = _cached(_inverse_frequencies)(head_dim, theta, scaling, device)
    factor = rope_attention_factor(dict(scaling) if scaling else None)
    return _rope_angles(torch.arange(seq, device=device), inv_freq, dtype, factor)


def _cached(table):
    """The lru_cache'd table function, or the function itself while torch.compile traces (Dynamo skips the cache
    anyway, and warns that it does): the compiled graph computes the table once per graph."""
    return table.__wrapped__ if torch.compiler.is_compiling() else table


def rope(x: torch.Tensor, theta: float, scaling: dict | None = None,
         positions: tuple[torch.Tensor, int] | torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embeddings, rotate-half convention (HF and Megatron), on [b, n, s, d] heads at positions 0..s-1, or at
    `positions` = (global positions [s/cp], sequence length s) of a context-parallel shard (no host sync), or at
    per-sequence positions [b, s] (positions restarting at each document); `scaling`: HF's rope parameters for
    "linear", "llama3" or "yarn" scaling (None: plain)."""
    key = tuple(sorted(scaling.items())) if scaling else None
    if isinstance(positions, torch.Tensor):  # [b, s]: each token's angles, as the table's rows (same fp32 products)
        inv_freq = _cached(_inverse_frequencies)(x.shape[-1], theta, key, x.device)
        angles = _rope_angles(positions, inv_freq, x.dtype, rope_attention_factor(scaling))
        cos, sin = (t.unsqueeze(1) for t in angles)  # [b, 1, s, d]
        return _rotate(x, cos, sin)
    positions, length = (None, x.shape[-2]) if positions is None else positions
    cos, sin = _cached(_rope_tables)(length, x.shape[-1], theta, key, x.device, x.dtype)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    return _rotate(x, cos, sin)


def _rotate(x, cos, sin):
    """x·cos + rotate_half(x)·sin: one fused kernel each way where the fused kernels run (kernels.ops.fused_kernels:
    CUDA under "auto"; every layout `rotary` makes, the partial and interleaved ones included), else torch."""
    if kernels.ops.fused_kernels(x.device):
        from kernels import rope as fused  # (imports triton: only where the fused kernels run)

        if fused.supports(x, cos):
            return fused.apply_rope(x, cos, sin)
    return x * cos + rotate_half(x) * sin


@functools.lru_cache(maxsize=16)
def _pairs_first(dims, device):
    return torch.cat([torch.arange(0, dims, 2), torch.arange(1, dims, 2)]).to(device)


def rotary(x: torch.Tensor, config: Any, positions: tuple[torch.Tensor, int] | torch.Tensor | None) -> torch.Tensor:
    """RoPE (`config`'s theta and scaling) on the first `config.rotary_percent` of each head's features of x
    [b, n, s, d], the rest passed through (GLM-4.5 rotates half). With `config.rope_interleave` the rotated features
    are pairs (x0, x1), (x2, x3), ... (DeepSeek's weights' layout): they come out in rotate-half order, evens then
    odds, as Hugging Face's apply_rotary_pos_emb_interleave returns them (q and k alike: the same scores)."""
    dims = int(x.shape[-1] * config.rotary_percent)
    part = x if dims == x.shape[-1] else x[..., :dims]
    if config.rope_interleave:
        part = part.index_select(-1, _cached(_pairs_first)(dims, x.device))
    part = rope(part, config.rope_theta, config.rope_scaling, positions)
    return part if dims == x.shape[-1] else torch.cat([part, x[..., dims:]], dim=-1)
