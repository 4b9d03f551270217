"""[model]: the preset or Hugging Face model the job starts from, its size overrides, dropout, and a mixture of
experts' shape and training hyperparameters."""
import dataclasses
import math
from typing import Any

from ...config import MOE_DISPATCHERS, MOE_SCORES, PRESETS
from .fields import at_least, flag_field, flag_of, one_of

SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size")
# [model] fields that are GPTConfig fields of the same name: a mixture of experts' shape (a preset's otherwise; not
# with --from-hf, whose config has them), then its training hyperparameters (over a preset or a --from-hf model)
MOE_SHAPE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                    "moe_shared_expert_size", "moe_router_score")
MOE_TRAINING_FIELDS = ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_capacity_factor", "moe_dispatcher")


@dataclasses.dataclass
class ModelConfig:
    """[model]: a preset (tiny unless given) with size overrides, or a Hugging Face model to start from."""

    preset: str | None = flag_field(None, flag="model")
    from_hf: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    dropout: float = 0.0
    attention_dropout: float | None = None  # None: --dropout
    # a mixture of experts (GPTConfig's fields; None: the preset's, dense unless it has experts)
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | str | None = None  # N: every N-th layer; "0,1,1,1": a 0/1 per layer
    moe_shared_expert_size: int | None = None
    moe_router_score: str | None = None
    moe_aux_loss_coeff: float | None = None
    moe_z_loss_coeff: float | None = None
    moe_capacity_factor: float | None = None  # None: dropless (or the preset's)
    moe_dispatcher: str | None = None

    def validate(self) -> None:
        if self.preset is not None:
            one_of("--model", self.preset, tuple(sorted(PRESETS)))
        if self.from_hf:
            given = [("--model", self.preset),
                     *((flag_of(f), getattr(self, f)) for f in SIZE_FIELDS + MOE_SHAPE_FIELDS)]
            shape = [flag for flag, value in given if value is not None]
            if shape:
                raise ValueError(f"--from-hf takes the model's shape from its config: drop {' '.join(shape)}")
        at_least(self, ("num_experts",), 0)
        at_least(self, ("moe_router_topk", "moe_ffn_hidden_size"), 1)
        at_least(self, ("moe_shared_expert_size",), 0)
        self.layer_freq()
        for flag, value, allowed in (("--moe-router-score", self.moe_router_score, MOE_SCORES),
                                     ("--moe-dispatcher", self.moe_dispatcher, MOE_DISPATCHERS)):
            if value is not None:
                one_of(flag, value, allowed)
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{flag_of(name)}={value} must be a finite number >= 0 (0: off)")
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
        """The GPTConfig fields the [model] section's MoE flags give (those not left at None)."""
        fields = {f: getattr(self, f) for f in MOE_SHAPE_FIELDS + MOE_TRAINING_FIELDS if getattr(self, f) is not None}
        if "moe_layer_freq" in fields:
            fields["moe_layer_freq"] = self.layer_freq()
        return fields
