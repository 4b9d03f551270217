"""[model]: the named shape or Hugging Face model the job starts from, the shape fields it overrides, dropout, and a
mixture of experts' shape and training hyperparameters."""
import dataclasses
import math
from typing import Any

from ...config import MOE_DISPATCHERS, MOE_SCORES, hf_families
from ...presets import DEFAULT_MODEL, MODELS
from .fields import at_least, flag_of, one_of, option

# [model] fields that replace the preset's GPTConfig field of the same name (not with --from-hf, whose config has
# them): its sizes, then the rest of its shape
SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "head_dim", "vocab_size")
# (hf_model_type: the Hugging Face family, whose tensor names the checkpoints use too)
SHAPE_FIELDS = SIZE_FIELDS + ("rope_theta", "norm_eps", "init_std", "make_vocab_size_divisible_by", "hf_model_type")
# [model] fields that are GPTConfig fields of the same name: a mixture of experts' shape (a preset's otherwise; not
# with --from-hf, whose config has them), then its training hyperparameters (over a preset or a --from-hf model)
MOE_SHAPE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                    "moe_shared_expert_size", "moe_router_score")
MOE_TRAINING_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor", "moe_dispatcher",
                       "moe_seq_aux_loss_coeff")
# multi-token prediction (GPTConfig's fields): its depth is the model's shape (not with --from-hf, whose checkpoint
# has them or not), its loss's weight a training hyperparameter
MTP_SHAPE_FIELDS, MTP_TRAINING_FIELDS = ("mtp_num_layers",), ("mtp_loss_scaling_factor",)
_PRESETS = "the preset's"  # what a shape field left unset means


@dataclasses.dataclass
class ModelConfig:
    """[model]: a named shape (models/presets.py) with any of its fields overridden, or a Hugging Face model to start
    from; dropout; a mixture of experts."""

    preset: str | None = option(None, f"a named shape, trained as it is or shrunk by the flags below (default: "
                                      f"{DEFAULT_MODEL})", flag="model", choices=MODELS, metavar="NAME")
    from_hf: str | None = option(
        None, "start from a Hugging Face Llama/Mistral/Qwen2/GPT-2 directory (save_pretrained); its own tokenizer is "
              "used when the directory holds one (else bytes: the vocabulary must cover 256)", metavar="PATH",
        path=True)
    hidden_size: int | None = option(None, f"the model's width (default: {_PRESETS})", metavar="H")
    num_layers: int | None = option(None, f"transformer blocks (default: {_PRESETS})", metavar="L")
    num_heads: int | None = option(None, f"attention heads (default: {_PRESETS})", metavar="A",
                                   aliases=("--num-attention-heads",))
    num_kv_heads: int | None = option(None, f"key/value heads, GQA's query groups (default: {_PRESETS})",
                                      metavar="K", aliases=("--num-query-groups",))
    ffn_hidden_size: int | None = option(None, f"the MLP's hidden size (default: {_PRESETS})", metavar="F")
    head_dim: int | None = option(None, f"each head's width (default: {_PRESETS}, else hidden / heads)",
                                  metavar="D", aliases=("--kv-channels",))
    vocab_size: int | None = option(None, "the vocabulary (default: the tokenizer's or token files', else "
                                          f"{_PRESETS}); padded to a multiple of tp * --make-vocab-size-divisible-by",
                                    metavar="V")
    rope_theta: float | None = option(None, f"RoPE's base (default: {_PRESETS})", metavar="THETA",
                                      aliases=("--rotary-base",))
    norm_eps: float | None = option(None, f"the norms' epsilon (default: {_PRESETS})", metavar="EPS",
                                    aliases=("--norm-epsilon",))
    init_std: float | None = option(None, f"the weights' initial standard deviation (default: {_PRESETS})",
                                    metavar="STD", aliases=("--init-method-std",))
    make_vocab_size_divisible_by: int | None = option(
        None, f"the vocabulary is padded to a multiple of tp times this (default: {_PRESETS})", metavar="N")
    hf_model_type: str | None = option(
        None, "the Hugging Face family --export-hf writes (default: --from-hf's, else inferred from the model; "
              "glm4_moe for a sigmoid router)", choices=hf_families(), metavar="TYPE")
    dropout: float = option(0.0, "residual (and, unless given, attention) dropout", metavar="P",
                            aliases=("--hidden-dropout",))
    attention_dropout: float | None = option(None, "attention-probability dropout (default: --dropout)", metavar="P")
    # a mixture of experts (GPTConfig's fields; None: the preset's, dense unless it has experts)
    num_experts: int | None = option(
        None, f"experts per MoE layer (tp.moe.MoE in the MLP's place; default: {_PRESETS}: tiny-moe, small-moe and "
              "the published mixtures have them)", metavar="E")
    moe_router_topk: int | None = option(None, f"experts each token is routed to (default: {_PRESETS})",
                                         metavar="K")
    moe_ffn_hidden_size: int | None = option(None, "each expert's FFN size (default: --ffn-hidden-size)", metavar="F")
    moe_layer_freq: int | str | None = option(
        None, "MoE on every N-th layer (from the first), or a 0/1 per layer (DeepSeek's dense first layers: 0,1,1,1)",
        metavar="N|0,1,..")
    moe_shared_expert_size: int | None = option(
        None, "an FFN of size S every token goes through beside the experts (0: none)", metavar="S",
        aliases=("--moe-shared-expert-intermediate-size",))
    moe_router_score: str | None = option(
        None, "softmax (Mixtral, Qwen) or sigmoid with DeepSeek-V3's auxiliary-loss-free bias, updated after each "
              "step (--moe-router-bias-update-rate)", choices=MOE_SCORES, aliases=("--moe-router-score-function",))
    moe_router_bias_update_rate: float = option(
        1e-3, "sigmoid routers: how far DeepSeek-V3's selection biases move after each optimizer step, toward even "
              "loads (0: frozen)", metavar="R")
    moe_aux_loss_coeff: float | None = option(
        None, "load-balancing loss coefficient (Switch; over each micro-batch's global tokens)", metavar="C")
    moe_z_loss_coeff: float | None = option(None, "router z-loss coefficient", metavar="Z")
    moe_capacity_factor: float | None = option(
        None, "each expert keeps at most ceil(tokens*k/E*X) slots of a micro-batch, the highest-weighted (default: "
              "dropless)", metavar="X", aliases=("--moe-expert-capacity-factor",))
    moe_dispatcher: str | None = option(
        None, "token dispatch over ep: all-to-all (the default) or all-gather (cheaper while ep < k)",
        choices=MOE_DISPATCHERS, aliases=("--moe-token-dispatcher-type",))
    moe_seq_aux_loss_coeff: float | None = option(
        None, "DeepSeek-V3's sequence-wise balance loss coefficient (per sequence; V3: 1e-4)", metavar="C")
    mtp_num_layers: int | None = option(
        None, f"multi-token prediction depths on the last stage (DeepSeek-V3: 1; default: {_PRESETS}, else 0)",
        metavar="D")
    mtp_loss_scaling_factor: float | None = option(
        None, "the MTP loss's weight beside the LM loss (default: the preset's, else 0.1)", metavar="W")

    def validate(self) -> None:
        if self.preset is not None:
            one_of("--model", self.preset, tuple(MODELS))
        if self.from_hf:
            given = [("--model", self.preset),
                     *((flag_of(f), getattr(self, f)) for f in SHAPE_FIELDS + MOE_SHAPE_FIELDS + MTP_SHAPE_FIELDS)]
            shape = [flag for flag, value in given if value is not None]
            if shape:
                raise ValueError(f"--from-hf takes the model's shape from its config: drop {' '.join(shape)}")
        at_least(self, ("head_dim", "vocab_size", "make_vocab_size_divisible_by", "moe_router_topk",
                        "moe_ffn_hidden_size"), 1)
        at_least(self, ("num_experts", "moe_shared_expert_size", "mtp_num_layers"), 0)
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag_of(name)}={value} must be a finite number > 0")
        self.layer_freq()
        for flag, value, allowed in (("--hf-model-type", self.hf_model_type, hf_families()),
                                     ("--moe-router-score", self.moe_router_score, MOE_SCORES),
                                     ("--moe-dispatcher", self.moe_dispatcher, MOE_DISPATCHERS)):
            if value is not None:
                one_of(flag, value, allowed)
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_seq_aux_loss_coeff", "mtp_loss_scaling_factor"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag_of(name)}={value} must be a finite number >= 0 (0: off)")
        rate = self.moe_router_bias_update_rate
        if not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"--moe-router-bias-update-rate={rate} must be a finite number >= 0 (0: the biases stay)")
        factor = self.moe_capacity_factor
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"--moe-capacity-factor={factor} must be a positive number (leave it out: dropless)")

    def layer_freq(self) -> int | list[int] | None:
        """--moe-layer-freq as GPTConfig takes it: N (every N-th layer, from the first) or a 0/1 list per layer."""
        value = self.moe_layer_freq
        if value is None or isinstance(value, int):
            if value is not None and value < 1:
                raise ValueError(f"--moe-layer-freq={value} must be >= 1 (or a 0/1 list per layer, e.g. 0,1,1,1)")
            return value
        items = value.strip().strip("[]").replace(" ", "").split(",")
        if len(items) == 1 and items[0].isdigit() and int(items[0]) >= 1:
            return int(items[0])
        if not all(i in ("0", "1") for i in items):
            raise ValueError(f"--moe-layer-freq={value!r} must be N >= 1 (every N-th layer) or a 0/1 list per layer, "
                             "e.g. 0,1,1,1")
        return [int(i) for i in items]

    def moe_fields(self) -> dict[str, Any]:
        """The GPTConfig fields the [model] section's MoE (and MTP) flags give (those not left at None)."""
        names = MOE_SHAPE_FIELDS + MOE_TRAINING_FIELDS + MTP_SHAPE_FIELDS + MTP_TRAINING_FIELDS
        fields = {f: getattr(self, f) for f in names if getattr(self, f) is not None}
        if "moe_layer_freq" in fields:
            fields["moe_layer_freq"] = self.layer_freq()
        return fields
