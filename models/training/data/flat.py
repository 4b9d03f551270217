"""The flat token file of earlier versions, still read: PREFIX.bin, the tokens back to back as little-endian
uint8/uint16/uint32, and its sidecar PREFIX.json, e.g.

    {"format": "tp-tokens", "version": 1, "dtype": "uint16", "count": 123456, "vocab_size": 50257, "eos_id": 50256}

("dtype", "count" and "vocab_size" are needed; a user's own tool may write the pair). New token files are Megatron's
PREFIX.bin + PREFIX.idx (indexed.py).
"""
import json
import os

import numpy as np

DTYPES = ("uint8", "uint16", "uint32")


def sidecar(path: str) -> str:
    """PREFIX.json of PREFIX.bin."""
    return os.path.splitext(path)[0] + ".json"


def read_header(path: str) -> dict:
    """The checked sidecar of token file `path` (a dict); one-line errors naming the file."""
    meta_path = sidecar(path)
    if not os.path.isfile(meta_path):
        raise ValueError(f"--data {path}: a token file needs its JSON sidecar {meta_path} (dtype, count, vocab_size) "
                         f"or, for Megatron's format, its index {os.path.splitext(path)[0]}.idx")
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
