"""What a `--data PATH` may be: one class per format, registered in FORMATS (name -> class, in the order a path is
tried), each answering the same protocol (`Format`): whether a path is of it (detect), its checks before any process
starts (check), the token file the run reads (its own, in place, or its token cache, tokenized first), its token
stream (open), the vocabulary and end-of-document id its own files name, and its documents. A new format is one
class here and one line in FORMATS; the plan (plan.py) asks each source's format and never its name.

- bundled: no --data, Python's own standard-library sources (windows.py), as bytes in memory or tokenized.
- indexed: Megatron's PREFIX.bin + PREFIX.idx (indexed.py), read in place.
- flat: the flat token file PREFIX.bin of earlier versions with its PREFIX.json sidecar (flat.py), read in place.
- save_to_disk, parquet, jsonl, text: documents (sources.py, arrow.py), tokenized once into the token cache
  (build.py); "text" is a .txt file, a directory of data files, or any other file, read by its files' suffixes.
"""
import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrow, flat, indexed, sources
from .build import build, cached_prefix
from .sft import MASK_SUFFIX
from .tokenizer import load_tokenizer, tokenizer_vocab_size
from .windows import CORPUS_MODULES, Tokens, corpus, corpus_text


@dataclass(frozen=True)
class Reading:
    """How every source of a run is read: its tokenizer directory (None: UTF-8 bytes), the column of rows, --sft,
    the token cache's directory; `null_vocab`: N of Megatron's NullTokenizer (ids below N, N the end of document;
    None: not one)."""

    tokenizer_dir: str | None
    column: str
    sft: bool
    cache_dir: str
    null_vocab: int | None = None

    def tokenizer(self) -> Any:
        """The loaded tokenizer (once per directory), or None for bytes."""
        return None if self.tokenizer_dir is None else load_tokenizer(self.tokenizer_dir)

    def tokenizer_vocab(self) -> int | None:
        return None if self.tokenizer_dir is None else tokenizer_vocab_size(self.tokenizer())


class Format:
    """One source of a run (`path` None: the bundled corpus) of one format: the protocol every format answers."""

    def __init__(self, path: str | None):
        self.path = path

    @staticmethod
    def detect(path: str | None) -> bool:
        """Whether `path` is of this format (the formats are tried in FORMATS' order)."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        """Its name in FORMATS."""
        return next(name for name, cls in FORMATS.items() if type(self) is cls)

    def check(self, reading: Reading) -> None:
        """One line (ValueError) naming the bad value unless the source reads as `reading` says; reads no more than
        headers, schemas and the start of a text file."""
        raise NotImplementedError

    def tokenized(self, reading: Reading) -> bool:
        """Whether the run reads the source through the token cache (its documents tokenized once) rather than its
        own token file."""
        return True

    def token_file(self, reading: Reading, *, build_missing: bool = True, progress: bool = True) -> str | None:
        """The token file the run reads (None: the bundled corpus as bytes, in memory): the source's own, or its
        token cache's PREFIX, tokenized first if missing and `build_missing` (else None)."""
        return cached(self.path, reading, build_missing=build_missing, progress=progress)

    def open(self, token_file: str | None) -> Tokens:
        """The token stream of `token_file` (this source's token_file)."""
        return indexed.read_tokens(indexed.read_index(token_file))

    def vocabulary(self) -> int | None:
        """The vocabulary its own files name (a flat token file's sidecar); None: the tokenizer's, or bytes."""
        return None

    def eod_id(self) -> int | None:
        """The end-of-document id its own files name, for a source that names its vocabulary (None: none)."""
        return None

    def documents(self, token_file: str | None) -> int | None:
        """How many documents `token_file` holds (None: it keeps no document index)."""
        return indexed.read_index(token_file).documents


def cached(text: str, reading: Reading, *, build_missing: bool, progress: bool) -> str | None:
    """The token cache's PREFIX of documents `text` (a file or directory), tokenized first if missing and
    `build_missing` (else None)."""
    prefix = cached_prefix(text, reading.tokenizer_dir, reading.cache_dir, column=reading.column, sft=reading.sft)
    if not indexed.exists(prefix):
        if not build_missing:
            return None
        build(text, reading.tokenizer_dir, prefix, column=reading.column, sft=reading.sft, progress=progress)
    return prefix


def check_mask(prefix: str, index: indexed.Index) -> indexed.Index:
    """The loss mask PREFIX_loss_mask of --sft's Megatron dataset PREFIX: there, with the same sequence lengths."""
    if not indexed.exists(prefix + MASK_SUFFIX):
        raise ValueError(f"--data {prefix}: --sft needs the loss mask beside it, {prefix}{MASK_SUFFIX}.bin/.idx "
                         "(python -m models.tokens --sft writes both)")
    mask = indexed.read_index(prefix + MASK_SUFFIX)
    if not np.array_equal(mask.lengths, index.lengths):
        raise ValueError(f"--data {prefix}: its loss mask {prefix}{MASK_SUFFIX} has other sequence lengths")
    return mask


# ---- the formats -----------------------------------------------------------------------------------------------------


class Bundled(Format):
    """No --data: the bundled corpus, bytes in memory, or tokenized into the cache under a tokenizer."""

    @staticmethod
    def detect(path):
        return path is None

    def check(self, reading):
        if reading.sft:
            raise ValueError("--sft needs --data: .jsonl or parquet rows with \"messages\"")

    def tokenized(self, reading):
        return reading.tokenizer_dir is not None

    def token_file(self, reading, *, build_missing=True, progress=True):
        if not self.tokenized(reading):
            return None
        return cached(bundled_text_file(reading.cache_dir), reading, build_missing=build_missing, progress=progress)

    def open(self, token_file):
        return corpus() if token_file is None else super().open(token_file)

    def documents(self, token_file):
        return len(CORPUS_MODULES) if token_file is None else super().documents(token_file)


def bundled_text_file(directory: str) -> str:
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


class Indexed(Format):
    """Megatron's indexed dataset PREFIX (PREFIX.bin + PREFIX.idx; also named as PREFIX.bin or PREFIX.idx), read in
    place; with --sft, its loss mask PREFIX_loss_mask beside it."""

    @staticmethod
    def detect(path):
        return path is not None and indexed.exists(sources.prefix_of(path))

    def check(self, reading):
        prefix = sources.prefix_of(self.path)
        index = indexed.read_index(prefix)
        if reading.tokenizer_dir is None and reading.null_vocab is None and index.dtype != np.uint8:
            raise ValueError(f"--data {self.path}: a Megatron dataset of {index.dtype.name} ids needs the vocabulary "
                             "it was tokenized with: give --tokenizer DIR (a Hugging Face tokenizer directory, "
                             "as save_pretrained writes), or --tokenizer-type NullTokenizer --vocab-size N for ids "
                             "below N")
        if reading.sft:
            check_mask(prefix, index)

    def tokenized(self, reading):
        return False

    def token_file(self, reading, *, build_missing=True, progress=True):
        return sources.prefix_of(self.path)


class FlatTokens(Format):
    """The flat token file PREFIX.bin with its PREFIX.json sidecar naming dtype, count, vocab_size (and eos_id), read
    in place."""

    @staticmethod
    def detect(path):
        return path is not None and path.endswith(".bin") and os.path.isfile(path)

    @functools.cached_property
    def header(self) -> dict:
        return flat.read_header(self.path)

    def check(self, reading):
        flat.read_header(self.path)
        if reading.sft:
            raise ValueError(f"--data {self.path}: --sft reads chats (.jsonl, parquet) or a Megatron pair with its "
                             f"{MASK_SUFFIX}, not a flat token file")

    def tokenized(self, reading):
        return False

    def token_file(self, reading, *, build_missing=True, progress=True):
        return os.path.abspath(self.path)

    def open(self, token_file):
        return flat.read(token_file)[0]

    def vocabulary(self):
        return self.header["vocab_size"]

    def eod_id(self):
        return self.header.get("eos_id")

    def documents(self, token_file):
        return None


class Documents(Format):
    """Documents to tokenize into the token cache: a file or directory of .txt, .jsonl/.json, .parquet, or a
    save_to_disk directory's Arrow files (sources.data_files), each file read by its suffix."""

    def check(self, reading):
        path = self.path
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
        if reading.sft and any(not f.endswith(sources.ROW_SUFFIXES) for f in files):
            bad = next(f for f in files if not f.endswith(sources.ROW_SUFFIXES))
            raise ValueError(f"--data {bad}: --sft reads rows with \"messages\" (.jsonl, parquet, save_to_disk), not "
                             "text")
        sources.check_columns(files, reading.column)


class SavedDataset(Documents):
    """A directory Hugging Face datasets' `save_to_disk` wrote (a DatasetDict's "train" split), read with pyarrow."""

    @staticmethod
    def detect(path):
        return path is not None and arrow.is_saved_dataset(path)


class Parquet(Documents):
    """A .parquet file: one document per row (--data-column, default "text"), streamed a row group at a time."""

    @staticmethod
    def detect(path):
        return path is not None and path.endswith(".parquet")


class JsonLines(Documents):
    """A .jsonl file (or .json, Megatron's loose JSON): one document per line, field "text" or --data-column."""

    @staticmethod
    def detect(path):
        return path is not None and path.endswith((".jsonl", ".json"))


class Text(Documents):
    """A .txt file (one document), a directory of .txt/.jsonl/.parquet files (searched recursively, sorted), or any
    other file, read as UTF-8 text; also a path that is not there (its check says so)."""

    @staticmethod
    def detect(path):
        return path is not None


FORMATS: dict[str, type[Format]] = {"bundled": Bundled, "indexed": Indexed, "flat": FlatTokens,
                                    "save_to_disk": SavedDataset, "parquet": Parquet, "jsonl": JsonLines,
                                    "text": Text}


def detect(path: str | None) -> Format:
    """The source `path` (None: the bundled corpus) as the first format in FORMATS it is."""
    return next(cls for cls in FORMATS.values() if cls.detect(path))(path)
