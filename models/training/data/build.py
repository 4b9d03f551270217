"""Tokenizing a source once into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx, one sequence per document,
each ended by the tokenizer's EOS), in the token cache or where `python -m models.tokens --out PREFIX` says.

The cache lives in --data-cache-dir (default: $XDG_CACHE_HOME/tp-layers/tokens, else ~/.cache/tp-layers/tokens),
never beside the data unless that flag says so. A cache file is named by a key over the tokenizer's files (not model
weights or config), the data files' paths, sizes and modification times, the column read and --sft: edited data or
another tokenizer make a new file, the same ones reuse it. Without a tokenizer the tokens are the UTF-8 bytes,
documents joined by a blank line (as the bundled corpus). Text streams through: ~1 MB pieces, batched into the
tokenizer, appended to the .bin, so a corpus larger than memory tokenizes.
"""
import hashlib
import os
import sys
from typing import Any

import numpy as np

from . import indexed, sources
from .sft import MASK_SUFFIX, render
from .tokenizer import load_tokenizer, tokenizer_vocab_size

FORMAT = "tp-tokens-2"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_NOT_TOKENIZER = ("config.json", "generation_config.json")  # model files that do not change the tokenization
_BATCH_CHARS = 1 << 20  # characters per tokenizer call (the fast tokenizers batch in Rust)


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/tp-layers/tokens, else ~/.cache/tp-layers/tokens."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tp-layers", "tokens")


def _hash_tokenizer(digest, directory):
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n))
                   and not n.endswith(_WEIGHTS) and n not in _NOT_TOKENIZER and not n.endswith(".index.json"))
    for name in names:
        digest.update(name.encode() + b"\0")
        with open(os.path.join(directory, name), "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)


def cache_key(files: list[str], tokenizer_dir: str | None, *, column: str, sft: bool) -> str:
    """sha256 over the tokenizer directory's files and the data files' paths, sizes and modification times."""
    digest = hashlib.sha256(f"{FORMAT}\0{column}\0{int(sft)}\0".encode())
    if tokenizer_dir is None:
        digest.update(b"bytes\0")
    else:
        _hash_tokenizer(digest, tokenizer_dir)
    for path in files:
        stat = os.stat(path)
        digest.update(f"\0{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def cached_prefix(data: str, tokenizer_dir: str | None, cache_dir: str, *, column: str, sft: bool = False) -> str:
    """The PREFIX of the token cache of source --data DATA under --tokenizer (None: bytes)."""
    data = os.path.abspath(data)
    key = cache_key(sources.data_files(data), tokenizer_dir, column=column, sft=sft)
    kind = "bytes" if tokenizer_dir is None else os.path.basename(os.path.normpath(tokenizer_dir))
    return os.path.join(cache_dir, f"{os.path.basename(os.path.normpath(data))}-{kind}{'-sft' * sft}-{key}")


def build(data: str, tokenizer_dir: str | None, prefix: str, *, column: str, sft: bool = False,
          progress: bool = True) -> indexed.Index:
    """Tokenize source --data DATA (a file or directory) into the indexed dataset PREFIX; returns its index."""
    files = sources.data_files(data)
    tokenizer = None if tokenizer_dir is None else load_tokenizer(tokenizer_dir)
    vocab = 256 if tokenizer is None else tokenizer_vocab_size(tokenizer)
    bar = _bar(progress, sum(os.path.getsize(p) for p in files), f"tokenizing {data}")
    writers = [indexed.Writer(prefix, indexed.dtype_for(vocab))]
    try:
        if sft:
            writers.insert(0, indexed.Writer(prefix + MASK_SUFFIX, np.uint8))
            _write_chats(files, tokenizer, column, writers, bar)
        else:
            _write_text(files, tokenizer, column, writers[0], bar)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        bar.close()
    if not writers[-1].lengths:
        for writer in writers:
            writer.abort()
        raise ValueError(f"--data {data}: no text in {len(files)} file(s)")
    for writer in writers:  # the tokens' index last: its presence says the whole is complete
        writer.close()
    return indexed.read_index(prefix)


def _write_text(files, tokenizer, column, writer, bar):
    pieces, chars = [], 0

    def flush():  # one tokenizer call for many pieces (the fast tokenizers batch them in Rust)
        ids = None if tokenizer is None else tokenizer([p for p, _ in pieces], add_special_tokens=False)["input_ids"]
        for k, (piece, last) in enumerate(pieces):
            if ids is None:  # bytes: documents joined by a blank line
                raw = piece.encode("utf-8")
                separator = b"\n\n" if raw and writer.lengths and not writer.current else b""
                writer.append(np.frombuffer(separator + raw, dtype=np.uint8))
            else:
                writer.append(ids[k])
            if last and writer.current:  # (an empty document is left out)
                if ids is not None:
                    writer.append([tokenizer.eos_token_id])
                writer.end_document()
        pieces.clear()

    for piece, last, done in sources.text_pieces(files, column):
        pieces.append((piece, last))
        chars += len(piece)
        if chars >= _BATCH_CHARS:
            flush()
            chars = 0
        bar.update(done - bar.n)
    flush()


def _write_chats(files, tokenizer, column, writers, bar):
    masks, tokens = writers
    for messages, where, done in sources.rows(files, column):
        ids, mask = render(tokenizer, messages, where)
        tokens.add_document(ids)
        masks.add_document(np.asarray(mask, dtype=np.uint8))
        bar.update(done - bar.n)


def _bar(show: bool, total: int, what: str) -> Any:
    from tqdm import tqdm

    # on a terminal only: no carriage-return lines in a log file
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, disable=None if show else True,
                file=sys.stderr, dynamic_ncols=True)
