"""[data] and [evaluation]: the training data (one source or a blend), its tokenizer and documents; the validation
loss on the held-out windows."""
import dataclasses
import math

from .fields import at_least, option

TOKENIZER_TYPES = ("NullTokenizer", "HuggingFaceTokenizer")  # Megatron's --tokenizer-type values read here


@dataclasses.dataclass
class DataConfig:
    """[data]: the training data (None: the bundled corpus), one source or a blend's WEIGHT PATH pairs (Megatron's
    `--data 0.3 A 0.7 B`), its tokenizer (None: bytes), the column of rows to read, chat fine-tuning, the token
    cache's directory (None: the user's cache); the documents inside each window."""

    path: list[str] | None = option(
        None, "training data: a Megatron indexed dataset PREFIX (PREFIX.bin + PREFIX.idx); a .txt, .jsonl or .json "
              "(JSON lines) or .parquet file, a directory of them, or a Hugging Face save_to_disk directory, "
              "tokenized once into the token cache; a flat token file PREFIX.bin with its PREFIX.json; or a blend of "
              "them, Megatron's WEIGHT PATH pairs (--data 0.3 A 0.7 B); default: the bundled corpus",
        flag="data", metavar="PATH", aliases=("--data-path",), path=True)
    tokenizer: str | None = option(
        None, "a local Hugging Face tokenizer directory (AutoTokenizer): text is tokenized once, documents ended by "
              "its EOS; the model's vocabulary follows it (a Megatron dataset's ids are checked against it); "
              "default: bytes", metavar="DIR", path=True, aliases=("--tokenizer-model",))
    tokenizer_type: str | None = option(
        None, "Megatron's: NullTokenizer reads pretokenized ids below --vocab-size N with no tokenizer (a Megatron "
              ".bin/.idx pair or a flat token file), N the end of document, the model's vocabulary N + 1; "
              "HuggingFaceTokenizer is --tokenizer's (the default when one is given)", choices=TOKENIZER_TYPES)
    column: str | None = option(None, "the JSON field or parquet/Arrow column to read (default: text; messages with "
                                      "--sft)", flag="data_column", metavar="NAME")
    sft: bool = option(False, "chat fine-tuning: rows of \"messages\" rendered by the tokenizer's chat template, only "
                              "the assistant's tokens in the loss; conversations packed whole into windows, a longer "
                              "one left out and counted")
    cache_dir: str | None = option(
        None, "where tokenized data is cached (default: $XDG_CACHE_HOME/tp-layers/tokens, else "
              "~/.cache/tp-layers/tokens; on several nodes, a directory they share)", flag="data_cache_dir",
        metavar="DIR", path=True)
    # documents inside a window, ended by the EOD token (Megatron's flags; models/training/documents.py): the
    # tokenizer's EOS, or a token file's eos_id
    reset_position_ids: bool = option(False, "positions restart at each document's first token")
    reset_attention_mask: bool = option(
        False, "attention stays inside each document (block-diagonal causal); positions restart too only with "
               "--reset-position-ids")
    eod_mask_loss: bool = option(False, "no loss on the token predicted from an end-of-document token")

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

    eval_every: int = option(0, "validation loss (val_loss) on the held-out last ~1% of the data every N steps and "
                                "at the end (0: never)", metavar="N", aliases=("--eval-interval",))
    eval_iters: int = option(10, "global batches per validation", metavar="K")
    eval_only: bool = option(False, "evaluate the --load checkpoint (or the --from-hf model) and exit")

    def validate(self) -> None:
        at_least(self, ("eval_every",), 0)
        at_least(self, ("eval_iters",), 1)
