"""[data] and [evaluation]: the training data (one source or a blend), its tokenizer and documents; the validation
loss on the held-out windows."""
import dataclasses
import math

from .fields import at_least, flag_field


@dataclasses.dataclass
class DataConfig:
    """[data]: the training data (None: the bundled corpus), one source or a blend's WEIGHT PATH pairs (Megatron's
    `--data 0.3 A 0.7 B`), its tokenizer (None: bytes), the column of rows to read, chat fine-tuning, the token
    cache's directory (None: the user's cache); the documents inside each window."""

    path: list[str] | None = flag_field(None, flag="data")
    tokenizer: str | None = None
    column: str | None = flag_field(None, flag="data_column")  # None: "text" ("messages" with --sft)
    sft: bool = False
    cache_dir: str | None = flag_field(None, flag="data_cache_dir")
    # documents inside a window, ended by the EOD token (Megatron's flags; models/training/documents.py)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def validate(self) -> None:
        """The blend's syntax and weights (the paths are read by preflight.py)."""
        self.blend()
        if self.column is not None and not self.column:
            raise ValueError("--data-column is empty: name the column (or JSON field) to read")

    def blend(self) -> list[tuple[float, str | None]]:
        """[(weight, path), ...]: --data PATH alone (weight 1), or its WEIGHT PATH pairs; [(1, None)] for the bundled
        corpus. One line if the values are not that."""
        if not self.path:
            return [(1.0, None)]
        given = " ".join(self.path)
        if len(self.path) == 1:
            return [(1.0, self.path[0])]
        if len(self.path) % 2:
            raise ValueError(f"--data {given}: a blend is WEIGHT PATH pairs, e.g. --data 0.3 PREFIX_A 0.7 PREFIX_B")
        pairs = []
        for weight, path in zip(self.path[::2], self.path[1::2]):
            try:
                value = float(weight)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"--data {given}: the weight {weight!r} of {path} is not a positive number (a "
                                 "blend is WEIGHT PATH pairs, e.g. --data 0.3 PREFIX_A 0.7 PREFIX_B)")
            pairs.append((value, path))
        return pairs


@dataclasses.dataclass
class EvaluationConfig:
    """[evaluation]: validation loss on the held-out data."""

    eval_every: int = 0
    eval_iters: int = 10
    eval_only: bool = False

    def validate(self) -> None:
        at_least(self, ("eval_every",), 0)
        at_least(self, ("eval_iters",), 1)
