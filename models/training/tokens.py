"""Token files (Megatron's indexed-dataset idea, flat) and building one from a user's text.

A token file is PREFIX.bin, the tokens back to back as little-endian uint8/uint16/uint32, read with a numpy memmap,
and its sidecar PREFIX.json, a small header written last (its presence means the .bin is complete):

    {"format": "tp-tokens", "version": 1, "dtype": "uint16", "count": 123456, "vocab_size": 50257,
     "eos_id": 50256, "documents": 812, "tokenizer": "/path/to/tokenizer", "key": "..."}

Text (a .txt file, a directory of .txt/.jsonl files, field "text") is tokenized once with a local Hugging Face
tokenizer, each document followed by its EOS, into a cached token file beside the data (.tokens/ in the data's
directory), named by a key over the tokenizer's files and the data's bytes: changed data or another tokenizer make a
new file, the same ones reuse it. Without a tokenizer the tokens are the UTF-8 bytes, documents joined by a blank
line (as the bundled corpus). Build one ahead of time with `python -m models.tokens --data PATH --tokenizer DIR`.
"""
import argparse
import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

FORMAT, VERSION = "tp-tokens", 1
DTYPES = ("uint8", "uint16", "uint32")
TEXT_SUFFIXES = (".txt", ".jsonl")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_NOT_TOKENIZER = ("config.json", "generation_config.json")  # model files that do not change the tokenization
_CHUNK_CHARS = 1 << 20  # a long document is tokenized in pieces of ~1M characters cut at line ends


# ---- the format --------------------------------------------------------------------------------------------------


def sidecar(path: str) -> str:
    """PREFIX.json of PREFIX.bin."""
    return os.path.splitext(path)[0] + ".json"


def read_header(path: str) -> dict:
    """The checked sidecar of token file `path` (a dict); one-line errors naming the file."""
    meta_path = sidecar(path)
    if not os.path.isfile(meta_path):
        raise ValueError(f"--data {path}: a token file needs its JSON sidecar {meta_path} (dtype, count, vocab_size)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--data {path}: unreadable sidecar {meta_path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES:
        raise ValueError(f"--data {path}: sidecar {meta_path} needs \"dtype\" one of {DTYPES}")
    for field in ("count", "vocab_size"):
        if isinstance(meta.get(field), bool) or not isinstance(meta.get(field), int) or meta[field] < 1:
            raise ValueError(f"--data {path}: sidecar {meta_path} needs \"{field}\" an integer >= 1, got "
                             f"{meta.get(field)!r}")
    expected = meta["count"] * np.dtype(meta["dtype"]).itemsize
    if os.path.getsize(path) != expected:
        raise ValueError(f"--data {path}: {os.path.getsize(path)} bytes, but the sidecar's count={meta['count']} "
                         f"{meta['dtype']} tokens make {expected}")
    return meta


def read(path: str) -> tuple[np.memmap, dict]:
    """(tokens: a read-only numpy memmap [count], header dict) of token file `path`."""
    meta = read_header(path)
    return np.memmap(path, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r", shape=(meta["count"],)), meta


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned dtype holding ids [0, vocab_size)."""
    return next(d for d in DTYPES if vocab_size <= np.iinfo(d).max + 1)


class _Writer:
    """Appends token arrays to PREFIX.bin.tmp; `close` renames it and writes the sidecar last (readers never see a
    half-written file; two builders of one key write identical files, the last rename wins)."""

    def __init__(self, path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype).newbyteorder("<"), 0
        self.tmp = f"{path}.tmp{os.getpid()}"
        self.file = open(self.tmp, "wb")

    def write(self, ids):
        array = np.asarray(ids, dtype=self.dtype)
        array.tofile(self.file)
        self.count += len(array)

    def close(self, **meta):
        self.file.close()
        os.replace(self.tmp, self.path)
        header = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name, "count": self.count} | meta
        with open(f"{sidecar(self.path)}.tmp{os.getpid()}", "w") as f:
            json.dump(header, f, indent=1)
        os.replace(f"{sidecar(self.path)}.tmp{os.getpid()}", sidecar(self.path))

    def abort(self):
        self.file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


# ---- text sources ------------------------------------------------------------------------------------------------


def text_files(path: str) -> list[str]:
    """The text files of --data PATH: the file itself, or a directory's .txt/.jsonl files (recursively, sorted,
    hidden entries skipped)."""
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files)
                  if f.endswith(TEXT_SUFFIXES) and not f.startswith(".")]
    return found


def documents(files: list[str]) -> Iterator[tuple[str, int]]:
    """Yield (document text, bytes of the source read so far): a .txt file is one document, a .jsonl line one (and
    a line of a .json file given as --data: Megatron's loose JSON, one object per line)."""
    done = 0
    for path in files:
        if path.endswith((".jsonl", ".json")):
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    done += len(line)
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"--data {path} line {number}: not JSON ({e})") from None
                    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                        raise ValueError(f"--data {path} line {number}: no string field \"text\"")
                    yield row["text"], done
        else:
            with open(path, "rb") as f:
                raw = f.read()
            done += len(raw)
            yield raw.decode("utf-8", errors="replace"), done


def _pieces(text):
    """A document in pieces of ~_CHUNK_CHARS characters, each cut after a line end where there is one."""
    start = 0
    while start < len(text):
        stop = start + _CHUNK_CHARS
        if stop < len(text):
            cut = text.rfind("\n", start, stop)
            stop = cut + 1 if cut > start else stop
        yield text[start:stop]
        start = stop


# ---- tokenizers and the cache key --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def load_tokenizer(directory: str) -> Any:
    """transformers.AutoTokenizer of a local directory (no downloads); one-line errors."""
    if not os.path.isdir(directory):
        raise ValueError(f"--tokenizer {directory}: no such directory (a Hugging Face tokenizer directory)")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"--tokenizer {directory}: reading a tokenizer needs transformers (pip install -e "
                         "'.[hf]')") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--tokenizer {directory}: cannot load a tokenizer: {first}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer {directory}: the tokenizer has no EOS token to end documents with")
    return tokenizer


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Ids the tokenizer can emit: its vocabulary with the added tokens."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def has_tokenizer(directory: str) -> bool:
    """Whether a (Hugging Face model) directory holds tokenizer files."""
    return any(os.path.isfile(os.path.join(directory, name))
               for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def _hash_files(digest, paths, root):
    for path in paths:
        digest.update(os.path.relpath(path, root).encode() + b"\0" + str(os.path.getsize(path)).encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)


def cache_key(files: list[str], data_root: str, tokenizer_dir: str | None) -> str:
    """sha256 over the tokenizer directory's files (not model weights or config) and the data files' bytes."""
    digest = hashlib.sha256(f"{FORMAT}-{VERSION}\0".encode())
    if tokenizer_dir is None:
        digest.update(b"bytes\0")
    else:
        names = sorted(n for n in os.listdir(tokenizer_dir) if os.path.isfile(os.path.join(tokenizer_dir, n))
                       and not n.endswith(_WEIGHTS) and n not in _NOT_TOKENIZER and not n.endswith(".index.json"))
        _hash_files(digest, [os.path.join(tokenizer_dir, n) for n in names], tokenizer_dir)
    digest.update(b"\0data\0")
    _hash_files(digest, files, data_root)
    return digest.hexdigest()[:16]


def cached_path(data: str, tokenizer_dir: str | None, cache_dir: str | None = None) -> str:
    """Where the token file of text --data DATA under --tokenizer (None: bytes) lives: .tokens/ beside the data
    (inside a data directory), or `cache_dir`."""
    data = os.path.abspath(data)
    files = text_files(data)
    root = data if os.path.isdir(data) else os.path.dirname(data)
    key = cache_key(files, root, tokenizer_dir)
    kind = "bytes" if tokenizer_dir is None else os.path.basename(os.path.normpath(tokenizer_dir))
    name = f"{os.path.basename(os.path.normpath(data))}-{kind}-{key}.bin"
    return os.path.join(cache_dir or os.path.join(root, ".tokens"), name)


# ---- building ----------------------------------------------------------------------------------------------------


def build(data: str, tokenizer_dir: str | None, out: str, *, progress: bool = True) -> dict:
    """Tokenize text --data DATA (a file or directory) into token file `out` (.bin + .json); returns its header."""
    files = text_files(data)
    total = sum(os.path.getsize(p) for p in files)
    tokenizer = None if tokenizer_dir is None else load_tokenizer(tokenizer_dir)
    vocab = 256 if tokenizer is None else tokenizer_vocab_size(tokenizer)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    writer, docs, batch, chars = _Writer(out, dtype_for(vocab)), 0, [], 0
    bar = _bar(progress, total, f"tokenizing {data}")

    def flush():  # one tokenizer call for many documents (the fast tokenizers batch in Rust)
        ids = iter(tokenizer([piece for pieces in batch for piece in pieces], add_special_tokens=False)["input_ids"])
        tokens = []
        for pieces in batch:
            for _ in pieces:
                tokens += next(ids)
            tokens.append(tokenizer.eos_token_id)
        writer.write(tokens)
        batch.clear()

    try:
        for text, done in documents(files):
            if not text:
                continue
            if tokenizer is None:
                writer.write(np.frombuffer((b"\n\n" if docs else b"") + text.encode("utf-8"), dtype=np.uint8))
            else:
                batch.append(list(_pieces(text)))
                chars += len(text)
                if chars >= _CHUNK_CHARS:
                    flush()
                    chars = 0
            docs += 1
            bar.update(done - bar.n)
        if batch:
            flush()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if docs == 0:
        writer.abort()
        raise ValueError(f"--data {data}: no text in {len(files)} file(s)")
    eos = None if tokenizer is None else tokenizer.eos_token_id
    writer.close(vocab_size=vocab, eos_id=eos, documents=docs,
                 tokenizer=None if tokenizer_dir is None else os.path.abspath(tokenizer_dir),
                 source=os.path.abspath(data))
    return read_header(out)


def _bar(show, total, what):
    from tqdm import tqdm

    # on a terminal only: no carriage-return lines in a log file
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, disable=None if show else True,
                file=sys.stderr, dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.tokens", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a .txt/.jsonl file or a directory of them")
    p.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer directory (default: bytes)")
    p.add_argument("--out", default=None, help="PREFIX.bin to write (default: the cache beside the data)")
    args = p.parse_args(argv)
    try:
        if not os.path.exists(args.data):
            raise ValueError(f"--data {args.data}: no such file or directory")
        if args.out is not None and not args.out.endswith(".bin"):  # (--data reads anything else as text)
            raise ValueError(f"--out {args.out}: a token file is PREFIX.bin (its sidecar PREFIX.json beside it)")
        out = args.out or cached_path(args.data, args.tokenizer)
        meta = build(args.data, args.tokenizer, out)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: {meta['count']:,} {meta['dtype']} tokens, {meta['documents']:,} documents, "
          f"vocab_size {meta['vocab_size']}")
    return 0

