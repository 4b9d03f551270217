"""[training] and [optimizer]: steps, batch sizes, sequence length, precision, clipping; AdamW and its learning
rate schedule."""
import dataclasses
import math

from ...config import FP8_RECIPES
from ..lr_decay import DECAY_STYLES, Decay
from .fields import at_least, flag_of, one_of, option

PRECISIONS = ("fp32", "tf32", "bf16")
COMPILE = ("auto", "on", "off")  # --compile's values (TOML: also true / false)
LR_DECAY_STYLES = tuple(DECAY_STYLES)


@dataclasses.dataclass
class TrainingConfig:
    """[training]: steps, batch sizes, sequence length, seed, precision, gradient clipping."""

    steps: int = option(100, "optimizer steps", aliases=("--train-iters",))
    global_batch_size: int = option(16, "sequences per optimizer step, over all dp ranks")
    micro_batch_size: int = option(2, "sequences per micro-batch")
    seq_len: int = option(64, "tokens per sequence", aliases=("--seq-length",))
    seed: int = option(1234, "seed of the weights, the data order and dropout")
    precision: str | None = option(
        None, "bf16: bf16 parameters and activations, fp32 master weights, fp32 gradient accumulation and reduction "
              "(the GPU default; fp32 on the CPU, where bf16 matmuls are slow); tf32: fp32 with TensorFloat-32 "
              "matmuls on GPUs (fp32 there is the exact, slow IEEE dot)",
        metavar="{" + ",".join(PRECISIONS) + "}",  # (checked by validate, which says why fp16 is not)
        consts={"--bf16": "bf16"})
    fp8_recipe: str | None = option(
        None, "the blocks' linears in float8 with dynamic scales (torchao's recipes: tensorwise, one scale per tensor, "
              "x and W in e4m3, output gradients in e5m2; rowwise, per row and column, all e4m3); master weights, "
              "gradients and the rest in --precision (docs/fp8.md)",
        choices=FP8_RECIPES)
    clip_grad: float = option(1.0, "clip the global gradient norm (over tp, pp and dp) to C (0: no clipping); a "
                                   "non-finite norm skips the step", metavar="C")
    check_inputs: bool = option(False, "assert every step that all tp ranks of a group read the same tokens (a "
                                       "checksum all-gather)")
    compile: bool | str = option(
        "auto", "torch.compile each transformer block (fullgraph, as torchtitan): no graph break, the same loss; auto: "
                "on for CUDA (unless --schedule or --recompute-modules ask for what it cannot trace), off on the CPU; "
                "--compile alone is on",
        choices=COMPILE, bare="on")
    check_for_nan_in_loss_and_grad: bool = option(
        True, "stop the job (one line naming the step and the rank, exit code 1; the checkpoints untouched) at a "
              "non-finite loss or after --max-skipped-steps consecutive steps skipped for a non-finite gradient norm")
    max_skipped_steps: int = option(3, "consecutive steps skipped for a non-finite gradient norm that stop the job "
                                       "(0: never)", metavar="N")

    def validate(self) -> None:
        at_least(self, ("global_batch_size", "micro_batch_size", "seq_len", "steps"), 1)
        at_least(self, ("max_skipped_steps",), 0)
        if not math.isfinite(self.clip_grad) or self.clip_grad < 0:
            raise ValueError(f"--clip-grad={self.clip_grad} must be a finite number >= 0 (0: no clipping)")
        if self.fp8_recipe is not None:
            one_of("--fp8-recipe", self.fp8_recipe, FP8_RECIPES)
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"--precision={self.precision} is not supported: fp32, tf32 or bf16 (fp16 would need "
                             "loss scaling)")

    def resolve_compile(self, device: str, *, compilable: bool = True) -> None:
        """--compile auto|on|off (or a TOML bool) -> a bool: auto is on for CUDA (where the job is `compilable`),
        off for the CPU."""
        if isinstance(self.compile, bool):
            return
        if self.compile not in COMPILE:
            raise ValueError(f"--compile={self.compile!r} must be one of {', '.join(COMPILE)} (TOML: or true, false)")
        self.compile = {"on": True, "off": False}.get(self.compile, device == "cuda" and compilable)


@dataclasses.dataclass
class OptimizerConfig:
    """[optimizer]: AdamW's peak learning rate, its warm-up and decay (Megatron's flags), weight decay, betas and
    epsilon."""

    lr: float = option(3e-3, "peak learning rate (AdamW; linear warm-up, then --lr-decay-style)")
    warmup_steps: int = option(5, "learning-rate warm-up steps", aliases=("--lr-warmup-iters",))
    weight_decay: float = option(0.01, "AdamW weight decay (not on norms and biases)")
    adam_beta1: float = option(0.9, "AdamW's beta1")
    adam_beta2: float = option(0.95, "AdamW's beta2")
    adam_eps: float = option(1e-8, "AdamW's epsilon")
    lr_decay_style: str = option(
        "cosine", "learning-rate decay after the warm-up, from --lr to --min-lr (Megatron's); wsd: "
                  "warmup-stable-decay", choices=LR_DECAY_STYLES)
    min_lr: float | None = option(None, "the learning rate the decay ends at (default: --lr / 10)")
    lr_decay_steps: int | None = option(
        None, "steps (from 0) over which the learning rate decays, --min-lr after (default: --steps)", metavar="N",
        aliases=("--lr-decay-iters",))
    lr_wsd_decay_steps: int | None = option(
        None, "wsd: the last N of the decay steps fall linearly to --min-lr (default: 10% of the decay steps)",
        metavar="N", aliases=("--lr-wsd-decay-iters",))

    def validate(self) -> None:
        for name, value in (("lr", self.lr), ("weight_decay", self.weight_decay)):
            if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
                raise ValueError(f"{flag_of(name)}={value} must be a finite number {'> 0' if name == 'lr' else '>= 0'}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{flag_of(name)}={getattr(self, name)} must be in [0, 1)")
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):
            raise ValueError(f"--adam-eps={self.adam_eps} must be a finite number > 0")
        at_least(self, ("warmup_steps",), 0)
        at_least(self, ("lr_decay_steps", "lr_wsd_decay_steps"), 1)
        one_of("--lr-decay-style", self.lr_decay_style, LR_DECAY_STYLES)
        if self.min_lr is not None and not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"--min-lr={self.min_lr} must be a number in [0, --lr={self.lr}]")

    def learning_rate(self, step: int, steps: int) -> float:
        """The learning rate of step `step` (from 0) of `steps`: linear warm-up over --warmup-steps, then
        --lr-decay-style from --lr down to --min-lr (default lr/10) at --lr-decay-steps (default `steps`, counted
        from step 0 as Megatron does), --min-lr after. wsd (warmup-stable-decay) stays at --lr until the last
        --lr-wsd-decay-steps of the decay, then falls linearly."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_steps = self.lr_decay_steps or steps
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / max(1, decay_steps - self.warmup_steps)))
        coeff = DECAY_STYLES[self.lr_decay_style](Decay(progress, step, decay_steps, self.lr_wsd_decay_steps))
        if coeff is None:
            return self.lr
        floor = 0.1 if self.min_lr is None else self.min_lr / self.lr
        return self.lr * (floor + (1 - floor) * coeff)
