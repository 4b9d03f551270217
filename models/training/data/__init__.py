"""Training data: the bundled corpus (byte tokens of Python's own standard-library sources, no downloads) or a
user's `--data`, one source or a blend (`--data 0.3 A 0.7 B`), tokenized with `--tokenizer`.

A source is a Megatron indexed dataset or a flat token file, read in place, or text, JSON lines, parquet or a
save_to_disk directory (sources.py), tokenized once into the token cache (build.py); `--sft` reads chat rows instead
(sft.py). The launcher checks everything before any process starts (`check_source`, `check_vocab`, `check_sizes`,
then `prepare` tokenizes); each rank opens the same windows (`shared_datasets`), its split held out per dataset, and
takes its slice of every global batch (windows.py).
"""
import hashlib
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset

from ..config import JobConfig
from ..launch import check_writable_dir
from . import flat, indexed, sources
from .blend import Blend
from .build import build, cached_prefix, default_cache_dir
from .sft import MASK_SUFFIX, ChatWindows, check_template, pack
from .tokenizer import has_tokenizer, load_tokenizer, tokenizer_vocab_size
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

__all__ = ["Blend", "ChatWindows", "HOLDOUT", "MASK_SUFFIX", "MicroBatch", "Source", "TokenWindows", "Tokens",
           "VOCAB_SIZE", "batches", "build", "cache_dir", "check_ids", "check_sizes", "check_source", "check_vocab",
           "column", "corpus", "corpus_text", "data_sources", "datasets", "eod_id", "eval_batches", "load", "prepare",
           "resolve", "shared_datasets", "split", "split_sizes", "tokenizer_dir", "vocab_size"]


@dataclass(frozen=True)
class Source:
    """One dataset of the run: its --data path (None: the bundled corpus) and blend weight."""

    path: str | None
    weight: float = 1.0

    @property
    def kind(self) -> str:
        """"bundled", or sources.kind's: "indexed", "flat", "arrow", "files"."""
        return "bundled" if self.path is None else sources.kind(self.path)

    @property
    def name(self) -> str:
        return self.path or "the corpus"


def data_sources(job: JobConfig) -> list[Source]:
    return [Source(p, w) for w, p in job.data.blend()]


def column(job: JobConfig) -> str:
    return job.data.column or (sources.SFT_COLUMN if job.data.sft else sources.DEFAULT_COLUMN)


def cache_dir(job: JobConfig) -> str:
    return job.data.cache_dir or default_cache_dir()


def tokenizer_dir(job: JobConfig) -> str | None:
    """--tokenizer, else a --from-hf directory's own tokenizer when it has one, else None (bytes)."""
    from_hf = job.model.from_hf
    if job.data.tokenizer:
        return job.data.tokenizer
    if from_hf and os.path.isdir(from_hf) and has_tokenizer(from_hf):
        return from_hf
    return None


def eod_id(job: JobConfig) -> int | None:
    """The id that ends every document in the token stream: the tokenizer's EOS, else a flat token file's `eos_id`;
    None for bytes (blank lines)."""
    directory = tokenizer_dir(job)
    if directory is not None:
        return load_tokenizer(directory).eos_token_id
    flats = [flat.read_header(s.path).get("eos_id") for s in data_sources(job) if s.kind == "flat"]
    return flats[0] if flats and all(f == flats[0] for f in flats) else None


# ---- checks before any process ---------------------------------------------------------------------------------------


def check_source(job: JobConfig) -> None:
    """The --data/--tokenizer/--sft checks that read no more than headers, schemas and the start of a text file
    (one line naming the bad value)."""
    directory = tokenizer_dir(job)
    if directory:
        tokenizer = load_tokenizer(directory)
        if job.data.sft:
            check_template(tokenizer, directory)
    elif job.data.sft:
        raise ValueError("--sft renders chats with a tokenizer's chat template: give --tokenizer DIR")
    for source in data_sources(job):
        _check_one(job, source, directory)
    if any(_tokenized(s, directory) for s in data_sources(job)):
        check_writable_dir("--data-cache-dir", cache_dir(job))


def _tokenized(source, directory):
    """Whether the source is tokenized into the cache (text, or the bundled corpus under a tokenizer)."""
    return source.kind in ("files", "arrow") or (source.kind == "bundled" and directory is not None)


def _check_one(job, source, directory):
    path, kind = source.path, source.kind
    if kind == "bundled":
        if job.data.sft:
            raise ValueError("--sft needs --data: .jsonl or parquet rows with \"messages\"")
        return
    if kind == "indexed":
        index = indexed.read_index(sources.prefix_of(path))
        if directory is None and index.dtype != np.uint8:
            raise ValueError(f"--data {path}: a Megatron dataset of {index.dtype.name} ids needs the vocabulary "
                             "it was tokenized with: give --tokenizer DIR")
        if job.data.sft:
            _mask_index(sources.prefix_of(path), index)
        return
    if kind == "flat":
        flat.read_header(path)
        if job.data.sft:
            raise ValueError(f"--data {path}: --sft reads chats (.jsonl, parquet) or a Megatron pair with its "
                             f"{MASK_SUFFIX}, not a flat token file")
        return
    if not os.path.exists(path):
        raise ValueError(sources.missing(path))
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ValueError(f"--data {path} is empty")
    files = sources.data_files(path)
    if not files:
        raise ValueError(f"--data {path} holds no .txt, .jsonl or .parquet files")
    if not any(os.path.getsize(f) for f in files):
        raise ValueError(f"--data {path}: its {len(files)} data file(s) are all empty")
    if len(files) == 1 and not files[0].endswith((".parquet", ".arrow")):
        sources.check_text(files[0])
    if job.data.sft and any(not f.endswith(sources.ROW_SUFFIXES) for f in files):
        bad = next(f for f in files if not f.endswith(sources.ROW_SUFFIXES))
        raise ValueError(f"--data {bad}: --sft reads rows with \"messages\" (.jsonl, parquet, save_to_disk), not text")
    sources.check_columns(files, column(job))


def _mask_index(prefix, index):
    if not indexed.exists(prefix + MASK_SUFFIX):
        raise ValueError(f"--data {prefix}: --sft needs the loss mask beside it, {prefix}{MASK_SUFFIX}.bin/.idx "
                         "(python -m models.tokens --sft writes both)")
    mask = indexed.read_index(prefix + MASK_SUFFIX)
    if not np.array_equal(mask.lengths, index.lengths):
        raise ValueError(f"--data {prefix}: its loss mask {prefix}{MASK_SUFFIX} has other sequence lengths")
    return mask


def vocab_size(job: JobConfig) -> int | None:
    """The vocabulary the data's ids need: the tokenizer's (and a flat token file's, if larger), a flat token
    file's, 256 for bytes; None for the bundled corpus as bytes (the model keeps its own)."""
    files = [flat.read_header(s.path)["vocab_size"] for s in data_sources(job) if s.kind == "flat"]
    if tokenizer_dir(job):
        return max([tokenizer_vocab_size(load_tokenizer(tokenizer_dir(job))), *files])
    if not job.data.path:
        return None
    return max([VOCAB_SIZE, *files])


def check_vocab(job: JobConfig, model_vocab: int) -> None:
    """One line if the data's ids do not fit a model of `model_vocab` tokens (a --from-hf model's is fixed)."""
    needed = vocab_size(job) or VOCAB_SIZE
    if needed <= model_vocab:
        return
    for source in data_sources(job):
        if source.kind == "flat" and flat.read_header(source.path)["vocab_size"] == needed:
            raise ValueError(f"--data {source.path} has vocab_size={needed} in its sidecar, more than the model's "
                             f"vocab_size={model_vocab}")
    if tokenizer_dir(job):
        what = f"--tokenizer {job.data.tokenizer}" if job.data.tokenizer else \
            f"the tokenizer of --from-hf {job.model.from_hf}"
        raise ValueError(f"{what} has {needed} tokens, more than the model's vocab_size={model_vocab}")
    raise ValueError(f"vocab_size={model_vocab} cannot hold the {VOCAB_SIZE} byte tokens")


def check_sizes(job: JobConfig, resolved: list[str | None] | None = None) -> list[str]:
    """One line if a dataset makes too few windows (fewer training windows than a global batch, for one dataset;
    none to train on or hold out, for a blend's); checks the datasets whose tokens are known without tokenizing,
    all of them given their `resolved` token files. Returns the notes to report (too-long conversations)."""
    notes = []
    for source, token_file in zip(data_sources(job), resolved or [None] * len(data_sources(job))):
        if resolved is None and source.kind not in ("indexed", "flat") and (source.path or tokenizer_dir(job)):
            continue  # text: its size is known once tokenized (prepare)
        notes += _open(job, source, token_file if resolved else _in_place(job, source))[2]
    return notes


# ---- token files, windows -------------------------------------------------------------------------------------------


def _in_place(job, source):
    """The token file a source reads without tokenizing: a Megatron PREFIX, a flat PREFIX.bin, None (bytes)."""
    if source.kind == "indexed":
        return sources.prefix_of(source.path)
    if source.kind == "flat":
        return os.path.abspath(source.path)
    return None


def resolve(job: JobConfig, *, build_missing: bool = True, progress: bool = True) -> list[str | None]:
    """Per source, the token file the run reads (None: the bundled corpus as bytes, in memory): a Megatron PREFIX or
    a flat PREFIX.bin in place, else the source's token cache PREFIX, tokenized first if missing and
    `build_missing` (else None for it)."""
    directory, found = tokenizer_dir(job), []
    for source in data_sources(job):
        if not _tokenized(source, directory):
            found.append(_in_place(job, source))
            continue
        text = source.path if source.path is not None else _bundled_text_file(cache_dir(job))
        prefix = cached_prefix(text, directory, cache_dir(job), column=column(job), sft=job.data.sft)
        if not indexed.exists(prefix):
            if not build_missing:
                found.append(None)
                continue
            build(text, directory, prefix, column=column(job), sft=job.data.sft, progress=progress)
        found.append(prefix)
    return found


def _bundled_text_file(directory):
    """The bundled corpus written as a text file (for a tokenizer to read), rewritten only when it changed."""
    text = corpus_text()
    path = os.path.join(directory, "corpus", "stdlib.txt")
    if not os.path.isfile(path) or _read(path) != text:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp{os.getpid()}", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(f"{path}.tmp{os.getpid()}", path)
    return path


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def load(token_file: str | None) -> Tokens:
    """The token stream of a token file: a memmap of a Megatron PREFIX's .bin or a flat PREFIX.bin, or the bundled
    corpus (None)."""
    if token_file is None:
        return corpus()
    if indexed.exists(token_file):
        return indexed.read_tokens(indexed.read_index(token_file))
    return flat.read(token_file)[0]


def check_ids(job: JobConfig, token_file: str, vocab: int) -> None:
    """One line if a token file a user gave holds an id outside [0, vocab) (scanned once per file version: a
    marker in the cache remembers it)."""
    tokens = load(token_file)
    if np.iinfo(tokens.dtype).max < vocab and np.iinfo(tokens.dtype).min >= 0:
        return
    stat = os.stat(indexed.bin_path(token_file) if indexed.exists(token_file) else token_file)
    key = f"{os.path.abspath(token_file)}\0{stat.st_size}\0{stat.st_mtime_ns}\0{vocab}"
    marker = os.path.join(cache_dir(job), "checked", hashlib.sha256(key.encode()).hexdigest()[:16])
    if os.path.isfile(marker):
        return
    step = 1 << 24
    for start in range(0, len(tokens), step):
        chunk = np.asarray(tokens[start:start + step])
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            where = start + int(np.flatnonzero(chunk == bad)[0])
            raise ValueError(f"--data {token_file}: token {where} is id {bad}, outside the vocabulary of "
                             f"{vocab} ids{f' of --tokenizer {tokenizer_dir(job)}' if tokenizer_dir(job) else ''}")
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        open(marker, "w").close()
    except OSError:  # (a cache that cannot be written: scanned again next time)
        pass


def _open(job, source, token_file):
    """(training windows, held-out windows, notes) of one source's token file."""
    seq_len, tokens = job.training.seq_len, load(token_file)
    if not job.data.sft:
        train, held, _ = split_sizes(len(tokens), seq_len)
        if train < 1 or (len(data_sources(job)) == 1 and job.training.global_batch_size > train):
            raise ValueError(_too_small(job, source, train, held))
        return (*split(tokens, seq_len), [])
    index = indexed.read_index(token_file)
    mask = indexed.read_tokens(_mask_index(token_file, index))
    starts, ends, too_long = pack(index.lengths, seq_len + 1)
    notes = [f"note: --sft: {too_long} of {len(index.lengths)} conversations in {source.name} are longer than "
             f"--seq-len + 1 = {seq_len + 1} tokens (the longest {int(index.lengths.max())}): left out, not "
             "truncated"] if too_long else []
    windows = ChatWindows(tokens, mask, starts, ends, seq_len, load_tokenizer(tokenizer_dir(job)).eos_token_id)
    held = max(1, math.ceil(len(windows) * HOLDOUT))
    if len(windows) - held < 1 or (len(data_sources(job)) == 1 and
                                   job.training.global_batch_size > len(windows) - held):
        raise ValueError(_too_small(job, source, max(0, len(windows) - held), held, chats=len(index.lengths)))
    return (*windows.split(held), notes)


def _too_small(job, source, train, held, chats=None):
    global_batch_size, seq_len = job.training.global_batch_size, job.training.seq_len
    what = f"windows of packed conversations ({chats} of them)" if chats is not None else "sequences"
    if len(data_sources(job)) > 1:
        return f"--data {source.name} makes {max(train, 0)} {what} of --seq-len={seq_len} to train on (and " \
               f"{held} held out): too few for a blend"
    return f"--global-batch-size={global_batch_size} exceeds the {max(train, 0)} {what} of --seq-len={seq_len} " \
           f"in {source.name} left for training ({held} held out for validation)"


def datasets(job: JobConfig, resolved: list[str | None]) -> tuple[Dataset, Dataset, list[str]]:
    """(training windows, held-out windows, notes) of the run: one source's, or a Blend of each source's split
    (seeded by --seed; the held-out blend in order)."""
    opened = [_open(job, s, t) for s, t in zip(data_sources(job), resolved)]
    notes = [note for *_, found in opened for note in found]
    if len(opened) == 1:
        return opened[0][0], opened[0][1], notes
    weights = [s.weight for s in data_sources(job)]
    return (Blend([o[0] for o in opened], weights, seed=job.training.seed),
            Blend([o[1] for o in opened], weights, seed=None), notes)


def _verified(job, *, progress):
    """The token files, built where missing, a user's token files' ids checked against the vocabulary."""
    resolved = resolve(job, progress=progress)
    vocab = vocab_size(job)
    for source, token_file in zip(data_sources(job), resolved):
        if source.kind in ("indexed", "flat") and vocab is not None:
            check_ids(job, token_file, vocab)
    return resolved


def prepare(job: JobConfig) -> None:
    """The launcher's part, before any rank starts: tokenize a user's text into its cache once (a progress bar on a
    terminal), check a user's token files' ids, then that every dataset fills its windows."""
    check_sizes(job, _verified(job, progress=True))


def shared_datasets(job: JobConfig, group: dist.ProcessGroup | None = None) -> tuple[Dataset, Dataset]:
    """(training windows, held-out windows) on every rank of a process group: rank 0 finds (or builds) the token
    files and checks them, the others read the files it names (one builder, never every rank racing); an error is
    raised on every rank, a note printed by rank 0."""
    holder = [None]
    if dist.get_rank(group) == 0:
        try:
            holder = [("ok", _verified(job, progress=False))]
        except (ValueError, OSError) as e:  # every rank raises it, none left waiting
            holder = [("error", str(e))]
    dist.broadcast_object_list(holder, group_src=0, group=group)
    status, value = holder[0]
    if status == "error":
        raise ValueError(value)
    train, held, notes = datasets(job, value)
    if dist.get_rank(group) == 0 and notes:
        print("\n".join(notes), file=sys.stderr, flush=True)
    return train, held
