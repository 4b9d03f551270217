"""Training data: the bundled corpus (byte tokens of Python's own standard-library sources, no downloads) or a
user's `--data`, one source or a blend (`--data 0.3 A 0.7 B`), tokenized with `--tokenizer`.

Each source is of one format (formats.py, registered in FORMATS): a Megatron indexed dataset or a flat token file,
read in place, or text, JSON lines, parquet or a save_to_disk directory (sources.py), tokenized once into the token
cache (build.py); `--sft` reads chat rows instead (sft.py). A job's data is resolved once per process into a
DataPlan (plan.py: `DataPlan.of(job)`), which every step after takes: the launcher checks everything before any
process starts (the plan's `check`, `check_vocab`, `check_sizes`), then tokenizes and says what it found (`prepare`);
each rank opens the same windows (`shared_datasets`), its split held out per dataset, and takes its slice of every
global batch (windows.py). The functions below that take a JobConfig plan it and ask the plan.
"""
from torch.utils.data import Dataset

from ..config import JobConfig
from . import flat, indexed
from .blend import Blend
from .build import build
from .formats import FORMATS, Format, Reading
from .plan import FOUND_FILE, DataPlan, Opened, Source
from .sft import MASK_SUFFIX, ChatWindows
from .windows import (
    HOLDOUT,
    VOCAB_SIZE,
    MicroBatch,
    Tokens,
    TokenWindows,
    batches,
    corpus,
    corpus_text,
    eval_batches,
    split,
    split_sizes,
)

__all__ = ["FORMATS", "FOUND_FILE", "Blend", "ChatWindows", "DataPlan", "Format", "HOLDOUT", "MASK_SUFFIX",
           "MicroBatch", "Opened", "Reading", "Source", "TokenWindows", "Tokens", "VOCAB_SIZE", "batches", "build",
           "corpus", "corpus_text", "data_sources", "datasets", "eod_id", "eval_batches", "load", "prepare", "resolve",
           "split", "split_sizes", "tokenizer_dir", "vocab_size"]


def load(token_file: str | None) -> Tokens:
    """The token stream of a token file: a memmap of a Megatron PREFIX's .bin or a flat PREFIX.bin, or the bundled
    corpus (None)."""
    if token_file is None:
        return corpus()
    if indexed.exists(token_file):
        return indexed.read_tokens(indexed.read_index(token_file))
    return flat.read(token_file)[0]


# ---- for callers holding a JobConfig, not its plan -------------------------------------------------------------------


def data_sources(job: JobConfig) -> list[Source]:
    return list(DataPlan.of(job).sources)


def tokenizer_dir(job: JobConfig) -> str | None:
    """--tokenizer, else a --from-hf directory's own tokenizer when it has one, else None (bytes)."""
    return DataPlan.of(job).reading.tokenizer_dir


def vocab_size(job: JobConfig) -> int | None:
    return DataPlan.of(job).vocab_size()


def eod_id(job: JobConfig) -> int | None:
    return DataPlan.of(job).eod_id()


def resolve(job: JobConfig, *, build_missing: bool = True, progress: bool = True) -> list[str | None]:
    return DataPlan.of(job).resolve(build_missing=build_missing, progress=progress)


def datasets(job: JobConfig, resolved: list[str | None]) -> tuple[Dataset, Dataset, list[str]]:
    return DataPlan.of(job).datasets(resolved)


def prepare(job: JobConfig) -> list[str]:
    return DataPlan.of(job).prepare()
