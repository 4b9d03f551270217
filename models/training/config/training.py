"""[training] and [optimizer]: steps, batch sizes, sequence length, precision, clipping; AdamW and its learning
rate schedule."""
import dataclasses
import math

from .fields import at_least, flag_of, one_of

PRECISIONS = ("fp32", "tf32", "bf16")
LR_DECAY_STYLES = ("cosine", "linear", "constant", "wsd")


@dataclasses.dataclass
class TrainingConfig:
    """[training]: steps, batch sizes, sequence length, seed, precision, gradient clipping."""

    steps: int = 100
    global_batch_size: int = 16
    micro_batch_size: int = 2
    seq_len: int = 64
    seed: int = 1234
    precision: str | None = None  # None: bf16 on CUDA, fp32 on the CPU (resolved by JobConfig.validate)
    clip_grad: float = 1.0
    check_inputs: bool = False
    compile: bool = False  # torch.compile each transformer block (fullgraph)

    def validate(self) -> None:
        at_least(self, ("global_batch_size", "micro_batch_size", "seq_len", "steps"), 1)
        if not math.isfinite(self.clip_grad) or self.clip_grad < 0:
            raise ValueError(f"--clip-grad={self.clip_grad} must be a finite number >= 0 (0: no clipping)")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"--precision={self.precision} is not supported: fp32, tf32 or bf16 (fp16 would need "
                             "loss scaling)")


@dataclasses.dataclass
class OptimizerConfig:
    """[optimizer]: AdamW's peak learning rate, its warm-up and decay (Megatron's flags), and weight decay."""

    lr: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.01
    lr_decay_style: str = "cosine"
    min_lr: float | None = None  # None: lr / 10
    lr_decay_steps: int | None = None  # None: --steps
    lr_wsd_decay_steps: int | None = None  # wsd's final decay; None: the last 10% of the decay steps

    def validate(self) -> None:
        for name, value in (("lr", self.lr), ("weight_decay", self.weight_decay)):
            if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
                raise ValueError(f"{flag_of(name)}={value} must be a finite number {'> 0' if name == 'lr' else '>= 0'}")
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
        if self.lr_decay_style == "constant":
            return self.lr
        floor = 0.1 if self.min_lr is None else self.min_lr / self.lr
        decay_steps = self.lr_decay_steps or steps
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / max(1, decay_steps - self.warmup_steps)))
        if self.lr_decay_style == "cosine":
            coeff = 0.5 * (1 + math.cos(math.pi * progress))
        elif self.lr_decay_style == "linear":
            coeff = 1.0 - progress
        else:  # wsd
            anneal = self.lr_wsd_decay_steps or max(1, math.ceil(0.1 * decay_steps))
            coeff = min(1.0, max(0.0, (decay_steps - step) / anneal))
        return self.lr * (floor + (1 - floor) * coeff)
