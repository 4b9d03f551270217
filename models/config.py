"""GPTConfig: one dataclass for the decoder-only transformers the package builds (Llama/Mistral/Qwen2/GPT-2 shapes)."""
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import tp.hf
import tp.moe
from kernels import fp8
from tp import context
from tp.moe.dispatch import DISPATCHERS
from tp.moe.router import SCORES

from .presets import MODELS, PRESETS, PUBLISHED_MODELS  # noqa: F401 (the named shapes, importable here as before)
from .recompute import DEFAULT_MODULES, GRANULARITIES, METHODS, MODULES, recompute_parts

ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
RECOMPUTE = tuple(GRANULARITIES)
RECOMPUTE_MODULES = tuple(MODULES)
RECOMPUTE_METHODS = tuple(METHODS)
MOE_SCORES = tuple(SCORES)
MOE_DISPATCHERS = tuple(DISPATCHERS)
QK_NORMS = ("head", "full")
# Fields that change how a model runs, not its weights: free to differ between a checkpoint and its resumption.
RUNTIME_FIELDS = ("sequence_parallel", "sequence_parallel_grad_sync", "recompute", "recompute_modules",
                  "recompute_method", "recompute_num_layers", "dropout", "attention_dropout", "dropout_seed", "cp_mode",
                  "cp_a2a_size", "moe_dispatcher", "fp8_recipe")
# the loss's weights and the experts' token dropping: training choices, no weights (Megatron's runtime arguments), so a
# resume or a fine-tune may change them as it may the learning rate
TRAINING_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor", "moe_seq_aux_loss_coeff",
                   "mtp_loss_scaling_factor")
CP_MODES = tuple(context.MODES)
FP8_RECIPES = tuple(fp8.FP8_RECIPES)


ROPE_SCALING_FIELDS = {"linear": ("factor",),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                       "yarn": ("factor", "original_max_position_embeddings")}
# the fields a scaling may leave out (Hugging Face's defaults: models/rope.py), numbers >= 0 when given
ROPE_SCALING_OPTIONAL = {"yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")}
# multi-head latent attention's sizes (Hugging Face's DeepSeek names), each an integer >= 1 under it
MLA_SIZES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def hf_families() -> tuple[str, ...]:
    """The Hugging Face families models.GPT reads and writes (hf_model_type): tp.hf.FAMILIES' with a config class."""
    return tuple(name for name, family in tp.hf.FAMILIES.items() if family.config_class)


HF_FAMILIES = hf_families()  # (as at import; hf_families() also sees a family registered later)


def _check_rope_scaling(scaling: Any, position: str) -> None:
    kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
    if kind not in ROPE_SCALING_FIELDS:
        raise ValueError(f"rope_scaling={scaling!r}: rope_type must be one of {tuple(ROPE_SCALING_FIELDS)}")
    if position != "rope":
        raise ValueError(f"rope_scaling={scaling!r} with position={position!r}: scaling applies to RoPE only")
    optional = ROPE_SCALING_OPTIONAL.get(kind, ())
    unknown = sorted(set(scaling) - {"rope_type", *ROPE_SCALING_FIELDS[kind], *optional})
    if unknown:
        raise ValueError(f"rope_scaling={scaling!r}: unknown fields {unknown} for {kind} scaling")
    bad = [f for f in optional if f in scaling and (isinstance(scaling[f], bool) or not isinstance(
        scaling[f], (int, float)) or not 0 <= scaling[f] < math.inf)]
    if bad:
        raise ValueError(f"rope_scaling={scaling!r}: {kind} scaling needs finite numbers >= 0 for {bad}")
    bad = [f for f in ROPE_SCALING_FIELDS[kind] if isinstance(scaling.get(f), bool)
           or not isinstance(scaling.get(f), (int, float)) or not 0 < scaling[f] < math.inf]
    if bad:
        raise ValueError(f"rope_scaling={scaling!r}: {kind} scaling needs finite positive numbers for {bad}")
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ValueError(f"rope_scaling={scaling!r}: llama3 scaling needs low_freq_factor < high_freq_factor")


@dataclass
class GPTConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None  # GQA/MQA; default num_heads
    head_dim: int | None = None  # default hidden_size // num_heads
    ffn_hidden_size: int | None = None  # default 4·hidden (gelu) or 8/3·hidden rounded up to 64 (swiglu)
    max_seq_len: int = 256
    activation: str = "swiglu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    position: str = "rope"
    rope_theta: float = 10000.0
    # HF's rope parameters for scaled RoPE: {"rope_type": "linear", "factor": f} or "llama3" (Llama 3.1+: factor,
    # low_freq_factor, high_freq_factor, original_max_position_embeddings) or "yarn" (DeepSeek-V3: factor,
    # original_max_position_embeddings, optionally beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor);
    # None: plain RoPE
    rope_scaling: dict | None = None
    rotary_percent: float = 1.0  # RoPE on this fraction of each head's features, the rest unrotated (GLM-4.5: 0.5)
    rope_interleave: bool = False  # the rotated features are pairs (x0, x1), (x2, x3), ... (DeepSeek-V3's layout)
    # Multi-head latent attention (DeepSeek-V2/V3; models/mla.py) in GQA's place: queries from a q_lora_rank latent
    # (None: straight from the hidden state), keys and values from one kv_lora_rank latent; each head's q and k of
    # qk_nope_head_dim + qk_rope_head_dim features (k's RoPE part one per token, shared by the heads), its v of
    # v_head_dim. head_dim and num_kv_heads do not apply.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    bias: bool = False  # every linear
    qkv_bias: bool = False  # the QKV projection only (Qwen2)
    tie_embeddings: bool = False
    dropout: float = 0.0  # embedding and residual-branch outputs
    attention_dropout: float = 0.0
    # keys the counter-based dropout masks, with each site's global index and each sample's (models/block.py)
    dropout_seed: int = 0
    sequence_parallel: bool = False
    # SP parameters (norms, row biases, learned positions) see one sequence shard: True sums their grads over tp
    # inside backward (one all-reduce per module; works under DDP and FSDP2); False tags them `sequence_parallel` for
    # one coalesced tp.allreduce_sequence_parallel_grads after backward (Megatron's way; not under FSDP2, whose
    # parameters lose the tags).
    sequence_parallel_grad_sync: bool = True
    recompute: str = "none"  # "selective": the recompute_modules; "full": every block (models/recompute.py)
    recompute_modules: tuple[str, ...] = DEFAULT_MODULES  # selective: Megatron-Core's module names (MODULES)
    recompute_method: str = "uniform"  # full: how the blocks are grouped (METHODS), with recompute_num_layers
    recompute_num_layers: int = 1
    # context parallelism (a cp group of the mesh): "ring" passes K/V around the group, overlapped with the blocks'
    # attention; "allgather" gathers K/V once (Llama 3's way); "a2a" (Ulysses) trades the sequence split for a head
    # split with all-to-alls; "a2a+ring": all-to-alls inside sub-groups of cp_a2a_size ranks, a ring across them
    cp_mode: str = "ring"
    cp_a2a_size: int | None = None  # (a2a+ring only)
    make_vocab_size_divisible_by: int = 128
    init_std: float = 0.02
    sliding_window: int | None = None  # not implemented: sequences longer than this are refused
    # the family save_hf writes, one of hf_families() (tp.hf.FAMILIES); None: GPT-2 for learned positions, else
    # Mixtral with experts, else Llama
    hf_model_type: str | None = None
    # q/k RMSNorm before RoPE: "head" (Qwen3: over each head's head_dim, one weight shared by the heads), "full"
    # (OLMoE: over the whole q and k projections); None: none
    qk_norm: str | None = None
    # Mixture of experts (tp.moe.MoE in place of the MLP): 0 experts, every layer dense.
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # each expert's FFN; default ffn_hidden_size
    # MoE on layers i with i % freq == 0, or a 0/1 list per layer (DeepSeek's first dense layers: [0, 0, 1, 1, ...])
    moe_layer_freq: int | list[int] = 1
    moe_shared_expert_size: int = 0  # an always-on FFN beside the experts (0: none)
    moe_shared_expert_gate: bool = False  # the shared expert times sigmoid(x·w_g) (Qwen2-MoE)
    moe_router_score: str = "softmax"  # or "sigmoid" (DeepSeek-V3, with a selection bias: tp.moe.update_expert_bias)
    moe_router_norm_topk: bool = True  # renormalise the k chosen weights (HF's norm_topk_prob)
    moe_aux_loss_coeff: float = 0.0  # load balancing (Switch), over the micro-batch's global tokens; 0: off
    moe_z_loss_coeff: float = 0.0  # router z-loss; 0: off
    moe_capacity_factor: float | None = None  # None: dropless; else each expert keeps ceil(T·k/E·factor) slots
    moe_dispatcher: str = "alltoall"  # or "allgather" (small ep)
    # DeepSeek's routing: the experts in moe_router_num_groups groups, each token choosing among the experts of its
    # moe_router_group_topk best groups only (a group's score: its best expert's, softmax; its best two's sum,
    # sigmoid); the combine weights times moe_router_topk_scaling_factor (HF's routed_scaling_factor)
    moe_router_num_groups: int = 1
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float = 1.0
    moe_seq_aux_loss_coeff: float = 0.0  # DeepSeek-V3's sequence-wise balance loss (per sequence); 0: off
    # Multi-token prediction (DeepSeek-V3; models/mtp.py): mtp_num_layers extra blocks on the last stage, depth k
    # predicting the token k + 1 after each position; their mean loss times mtp_loss_scaling_factor joins backward
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # the blocks' linears (attention's QKV and output projections, the MLP's fc1 and fc2) in float8: None or one of
    # FP8_RECIPES (kernels.fp8; docs/fp8.md); the embedding and the output layer stay in the model's dtype
    fp8_recipe: str | None = None

    def __post_init__(self) -> None:
        if self.multi_latent_attention and self.num_kv_heads not in (None, self.num_heads):
            raise ValueError(f"num_kv_heads={self.num_kv_heads} with multi_latent_attention: every head has its own "
                             f"keys and values (leave it None)")
        self.num_kv_heads = self.num_kv_heads or self.num_heads
        if self.head_dim is None and not self.multi_latent_attention and self.num_heads > 0 \
                and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}: give "
                             "head_dim (Megatron's kv_channels)")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_heads, 1)
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (-(-8 * self.hidden_size // 3 // 64) * 64 if self.activation == "swiglu"
                                    else 4 * self.hidden_size)
        self.recompute_modules = tuple(self.recompute_modules)
        for name, value, allowed in (("activation", self.activation, ACTIVATIONS), ("norm", self.norm, NORMS),
                                     ("position", self.position, POSITIONS),
                                     ("recompute", self.recompute, RECOMPUTE), ("cp_mode", self.cp_mode, CP_MODES),
                                     ("recompute_method", self.recompute_method, RECOMPUTE_METHODS),
                                     *(("recompute_modules", m, RECOMPUTE_MODULES) for m in self.recompute_modules)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} must be one of {allowed}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "ffn_hidden_size", "max_seq_len", "make_vocab_size_divisible_by", "recompute_num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.cp_a2a_size is not None and (self.cp_mode != "a2a+ring" or isinstance(self.cp_a2a_size, bool)
                                             or not isinstance(self.cp_a2a_size, int) or self.cp_a2a_size < 1):
            raise ValueError(f"cp_a2a_size={self.cp_a2a_size!r} must be an integer >= 1, with cp_mode='a2a+ring' "
                             f"(cp_mode={self.cp_mode!r})")
        if self.hf_model_type is not None and self.hf_model_type not in hf_families():
            raise ValueError(f"hf_model_type={self.hf_model_type!r} must be one of {hf_families()} (or None: "
                             "inferred)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} must be one of {QK_NORMS} (or None)")
        self._check_moe()
        self._check_mla()
        self._check_mtp()
        self._check_fp8()
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, self.position)
        if self.position == "rope" and not self.multi_latent_attention and int(self.head_dim * self.rotary_percent) % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rope" + (
                f" (its rotated part, rotary_percent={self.rotary_percent} of it)" if self.rotary_percent < 1 else ""))
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if isinstance(self.dropout_seed, bool) or not isinstance(self.dropout_seed, int):
            raise ValueError(f"dropout_seed={self.dropout_seed!r} must be an integer")

    def _check_moe(self):
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"num_experts={self.num_experts!r} must be an integer >= 0")
        if not self.num_experts:
            return
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        for name in ("moe_router_topk", "moe_ffn_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} > num_experts={self.num_experts}")
        for name, value, allowed in (("moe_router_score", self.moe_router_score, MOE_SCORES),
                                     ("moe_dispatcher", self.moe_dispatcher, MOE_DISPATCHERS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} must be one of {allowed}")
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            if len(freq) != self.num_layers or any(v not in (0, 1) or isinstance(v, float) for v in freq):
                raise ValueError(f"moe_layer_freq={list(freq)} must give 0 or 1 for each of the {self.num_layers} "
                                 "layers")
        elif isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ValueError(f"moe_layer_freq={freq!r} must be an integer >= 1 or a 0/1 list per layer")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_shared_expert_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.moe_capacity_factor is not None and not 0 < self.moe_capacity_factor < math.inf:
            raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor} must be a positive number (None: "
                             "dropless)")
        tp.moe.check_groups(self.num_experts, self.moe_router_topk, self.moe_router_num_groups,
                            self.moe_router_group_topk)
        for name in ("moe_seq_aux_loss_coeff", "moe_router_topk_scaling_factor"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name}={getattr(self, name)} must be a finite number >= 0")

    def _check_fp8(self):
        if self.fp8_recipe is None:
            return
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r} must be one of {FP8_RECIPES} (or None)")
        if self.multi_latent_attention:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r} with multi_latent_attention=True: latent attention has "
                             "no fp8 path (fp8 covers GQA attention, the MLP and the experts)")

    def _check_fp8_sizes(self, tp: int) -> None:
        """Each fp8 linear's weight on one of `tp` ranks: both dims multiples of 16 (torch._scaled_mm)."""
        d, h, ffn = self.head_dim, self.hidden_size, self.ffn_hidden_size
        kv_rows = max(self.num_kv_heads // tp, 1) * d  # (replicated when fewer than tp)
        fc1 = (2 if self.activation == "swiglu" else 1) * ffn // tp
        for what, in_features, out_features in (
                ("the QKV projection", h, self.num_heads * d // tp + 2 * kv_rows),
                ("the attention output projection", self.num_heads * d // tp, h),
                ("the MLP's fc1", h, fc1), ("the MLP's fc2", ffn // tp, h), *self._fp8_shared_expert(tp)):
            fp8.check_features(self.fp8_recipe, in_features, out_features, f"{what} at tp={tp}")

    def _fp8_shared_expert(self, tp):
        if not self.num_experts or not self.moe_shared_expert_size:
            return ()
        shared = self.moe_shared_expert_size // tp
        fc1 = 2 * shared if self.activation == "swiglu" else shared
        return ("the shared expert's fc1", self.hidden_size, fc1), ("the shared expert's fc2", shared, self.hidden_size)

    def _check_mla(self):
        if not 0 < self.rotary_percent <= 1:
            raise ValueError(f"rotary_percent={self.rotary_percent} must be in (0, 1]")
        if not self.multi_latent_attention:
            given = [f for f in ("q_lora_rank", *MLA_SIZES) if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{given[0]}={getattr(self, given[0])} is multi-head latent attention's: set "
                                 "multi_latent_attention=True (or leave it None)")
            return
        for name in ("q_lora_rank", *MLA_SIZES):
            value = getattr(self, name)
            if (value is not None or name != "q_lora_rank") and (isinstance(value, bool) or not isinstance(
                    value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1 with multi_latent_attention" +
                                 (" (or None: no query latent)" if name == "q_lora_rank" else ""))
        rotated = int(self.qk_rope_head_dim * self.rotary_percent)
        if self.position != "rope" or rotated % 2:
            raise ValueError(f"multi_latent_attention needs position='rope' and an even number of rotated features "
                             f"(qk_rope_head_dim={self.qk_rope_head_dim}, rotary_percent={self.rotary_percent})")
        for name in ("bias", "qkv_bias", "qk_norm"):
            if getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)!r} with multi_latent_attention: its projections have "
                                 "no biases and no q/k norms")

    def _check_mtp(self):
        n = self.mtp_num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"mtp_num_layers={n!r} must be an integer >= 0")
        if n and self.position != "rope":
            raise ValueError(f"mtp_num_layers={n} with position={self.position!r}: multi-token prediction is built "
                             "for RoPE models")
        if not 0 <= self.mtp_loss_scaling_factor < math.inf:
            raise ValueError(f"mtp_loss_scaling_factor={self.mtp_loss_scaling_factor} must be a finite number >= 0")

    @property
    def qk_head_dim(self) -> int:
        """Each head's query/key width: head_dim, or nope + rope features under multi-head latent attention."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def recompute_parts(self) -> frozenset[str]:
        """The parts of every block that recomputation drops in forward and recomputes (models/recompute.py)."""
        return recompute_parts(self.recompute, self.recompute_modules)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is a mixture of experts."""
        if not self.num_experts:
            return False
        freq = self.moe_layer_freq
        return bool(freq[layer]) if isinstance(freq, (list, tuple)) else layer % freq == 0

    def moe_layers(self, start: int = 0, stop: int | None = None) -> int:
        """How many of layers [start, stop) (default: all) are mixtures of experts."""
        stop = self.num_layers if stop is None else stop
        return sum(self.is_moe_layer(i) for i in range(start, stop)) if self.num_experts else 0

    def check_experts(self, ep: int, etp: int) -> None:
        """Raise a ValueError naming the value if the experts cannot be split over `ep` ranks and `etp` slices."""
        if not self.num_experts:
            return
        if self.num_experts % ep:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep={ep}")
        if self.moe_ffn_hidden_size % etp:
            raise ValueError(f"moe_ffn_hidden_size={self.moe_ffn_hidden_size} is not divisible by etp={etp}")
        if self.fp8_recipe is not None:  # each expert's local weights, as torch._scaled_mm takes them
            ffn = self.moe_ffn_hidden_size // etp
            fc1 = 2 * ffn if self.activation == "swiglu" else ffn
            fp8.check_features(self.fp8_recipe, self.hidden_size, fc1, f"the experts' fc1 at etp={etp}")
            fp8.check_features(self.fp8_recipe, ffn, self.hidden_size, f"the experts' fc2 at etp={etp}")

    def check_tp(self, tp: int) -> None:
        """Raise a ValueError naming the value if this model cannot be split across `tp` ranks."""
        if self.num_heads % tp:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by tp={tp}")
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} is not divisible by tp={tp}")
        if self.num_kv_heads < tp and tp % self.num_kv_heads:
            raise ValueError(f"tp={tp} is not divisible by num_kv_heads={self.num_kv_heads} (kv heads are "
                             f"replicated when fewer than tp)")
        if self.ffn_hidden_size % tp:
            raise ValueError(f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by tp={tp}")
        if self.num_experts and self.moe_shared_expert_size % tp:
            raise ValueError(f"moe_shared_expert_size={self.moe_shared_expert_size} is not divisible by tp={tp}")
        if self.fp8_recipe is not None:
            self._check_fp8_sizes(tp)

    def check_cp(self, cp: int, tp: int = 1) -> None:
        """Raise a ValueError naming the value if this model cannot run on a context-parallel group of `cp` ranks
        (with `tp` tensor-parallel ranks: the a2a modes split each rank's heads)."""
        mode = context.MODES[self.cp_mode]
        if cp == 1 or not mode.splits_heads:
            return
        if mode.sub_groups and (self.cp_a2a_size is None or cp % self.cp_a2a_size):
            raise ValueError(f"cp_mode={self.cp_mode!r} needs cp_a2a_size, a divisor of cp={cp}; got "
                             f"{self.cp_a2a_size}")
        size = context.heads_split(self.cp_mode, cp, self.cp_a2a_size)
        heads, kv_heads = self.num_heads // tp, max(self.num_kv_heads // tp, 1)  # per tp rank (kv replicated)
        if heads % size:
            raise ValueError(f"cp_mode={self.cp_mode!r} splits each tp rank's num_heads/tp={heads} (kv heads "
                             f"{kv_heads}) over {size} ranks: not divisible")
        if kv_heads % size and size % kv_heads:
            raise ValueError(f"cp_mode={self.cp_mode!r} splits each tp rank's kv heads over {size} ranks: kv heads "
                             f"{kv_heads} neither divides nor is divisible by {size} (num_heads/tp={heads} divides)")

    def check_seq_len(self, seq_len: int, *, tp: int = 1, cp: int = 1) -> None:
        """Raise a ValueError naming both numbers unless `seq_len` splits into 2·cp load-balanced chunks (and each
        cp rank's tokens over tp under sequence parallelism)."""
        factors = ([f"2*cp = 2*{cp} (context parallelism's load-balanced chunks)"] if cp > 1 else []) + \
            ([f"tp = {tp} (sequence parallelism)"] if self.sequence_parallel and tp > 1 else [])
        multiple = (2 * cp if cp > 1 else 1) * (tp if self.sequence_parallel else 1)
        if seq_len % multiple:
            raise ValueError(f"sequence length {seq_len} is not divisible by {multiple}: {' times '.join(factors)}")

    def padded_vocab_size(self, tp: int) -> int:
        """The vocabulary rounded up to a multiple of tp·make_vocab_size_divisible_by (Megatron's padding)."""
        multiple = tp * self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    def replace(self, **changes: Any) -> "GPTConfig":
        """A copy with `changes` to its fields (validated again)."""
        return dataclasses.replace(self, **changes)
