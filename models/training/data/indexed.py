"""Megatron-Core's indexed dataset (megatron/core/datasets/indexed_dataset.py), read in place and written.

PREFIX.bin holds the tokens of every sequence back to back; PREFIX.idx indexes them, little-endian:

    b"MMIDIDX\\x00\\x00", version <Q = 1, dtype code <B, sequence count n <Q, document count m + 1 <Q,
    then int32 sequence lengths [n], int64 byte pointers [n], int64 document indices [m + 1]
    (the sequence index where each document ends, starting with 0), and int8 modes [n] for multimodal data.

Sequences are contiguous and in order, so the .bin itself is the token stream: read as one numpy memmap, no
conversion. `Writer` appends one sequence per document (as Megatron's preprocess_data.py without sentence splitting)
and writes the index last, each file through a temporary name: an .idx present means its .bin is complete.
"""
import array
import os
import struct
from dataclasses import dataclass

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(d): code for code, d in DTYPES.items()}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, sequence count, document count: 34 bytes


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


@dataclass
class Index:
    """A checked PREFIX.idx: the token dtype, per-sequence lengths and byte pointers, document indices (views of
    the memory-mapped file), and the tokens the .bin holds."""

    prefix: str
    dtype: np.dtype
    lengths: np.ndarray  # int32 [n]
    pointers: np.ndarray  # int64 [n]
    document_indices: np.ndarray  # int64 [documents + 1]
    num_tokens: int

    @property
    def documents(self) -> int:
        return len(self.document_indices) - 1

    def document_span(self, d: int) -> tuple[int, int]:
        """The token offsets [start, end) of document d in the .bin (its sequences, back to back)."""
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        offset = lambda s: self.num_tokens if s == len(self.lengths) else int(self.pointers[s]) // self.dtype.itemsize
        return offset(first), offset(last)


def read_index(prefix: str, what: str = "--data") -> Index:
    """The index of PREFIX.idx, checked against PREFIX.bin; one-line errors naming `what` and the file."""
    path = idx_path(prefix)
    name = f"{what} {prefix}: {path}"
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_FIXED)
    if len(head) < _FIXED or head[:len(HEADER)] != HEADER:
        raise ValueError(f"{name} is not a Megatron index (its header is not {HEADER!r})")
    version, code, n, docs = struct.unpack("<QBQQ", head[len(HEADER):])
    if version != VERSION:
        raise ValueError(f"{name}: index version {version}, only {VERSION} is known")
    if code not in DTYPES or not np.issubdtype(DTYPES[code], np.integer):
        raise ValueError(f"{name}: dtype code {code} is not an integer token type "
                         f"({', '.join(f'{c} {np.dtype(d).name}' for c, d in DTYPES.items())})")
    body = n * 4 + n * 8 + docs * 8
    if size not in (_FIXED + body, _FIXED + body + n):  # (+ n: the int8 modes of multimodal data)
        raise ValueError(f"{name}: {size} bytes, but its {n} sequences and {docs} document indices make "
                         f"{_FIXED + body}: truncated or corrupt")
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(buffer, np.dtype("<i4"), n, _FIXED)
    pointers = np.frombuffer(buffer, np.dtype("<i8"), n, _FIXED + 4 * n)
    document_indices = np.frombuffer(buffer, np.dtype("<i8"), docs, _FIXED + 12 * n)
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    num_tokens = int(lengths.sum(dtype=np.int64))
    data_size = os.path.getsize(bin_path(prefix))
    if docs < 1 or document_indices[0] != 0 or document_indices[-1] != n:
        raise ValueError(f"{name}: its document indices run from {document_indices[:1].tolist()} to "
                         f"{document_indices[-1:].tolist()}, not from 0 to the sequence count {n}: corrupt")
    if num_tokens * dtype.itemsize != data_size or (n and (pointers[0] != 0 or pointers[-1] != data_size -
                                                             int(lengths[-1]) * dtype.itemsize)):
        raise ValueError(f"{what} {prefix}: {bin_path(prefix)} holds {data_size} bytes, but its index says "
                         f"{num_tokens} {dtype.name} tokens ({num_tokens * dtype.itemsize} bytes) back to back")
    return Index(prefix, dtype, lengths, pointers, document_indices, num_tokens)


def read_tokens(index: Index) -> np.ndarray:
    """Every token of PREFIX.bin, in order: a read-only memmap [num_tokens]."""
    if index.num_tokens == 0:
        return np.zeros(0, dtype=index.dtype)
    return np.memmap(bin_path(index.prefix), dtype=index.dtype, mode="r", shape=(index.num_tokens,))


def dtype_for(vocab_size: int) -> np.dtype:
    """Megatron's choice (DType.optimal_dtype): uint16 below 65500 ids, else int32; uint8 for 256 byte tokens."""
    if vocab_size <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class Writer:
    """Appends documents to PREFIX.bin (one sequence each: `append` its tokens, in as many calls as it takes, then
    `end_document`); `close` writes PREFIX.idx. A corpus larger than memory streams through: only the sequence
    lengths (4 bytes each) are held."""

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype).newbyteorder("<")
        if self.dtype.newbyteorder("=") not in CODES:
            raise ValueError(f"{self.dtype.name} is not a Megatron token dtype")
        self.lengths, self.current, self.num_tokens = array.array("i"), 0, 0
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self.tmp = f"{prefix}.tmp{os.getpid()}"
        self.file = open(self.tmp + ".bin", "wb")

    def append(self, ids: np.ndarray | list[int]) -> None:
        tokens = np.asarray(ids, dtype=self.dtype)
        tokens.tofile(self.file)
        self.current += len(tokens)
        self.num_tokens += len(tokens)

    def end_document(self) -> None:
        self.lengths.append(self.current)
        self.current = 0

    def add_document(self, ids: np.ndarray | list[int]) -> None:
        self.append(ids)
        self.end_document()

    def close(self) -> None:
        self.file.close()
        lengths = np.frombuffer(self.lengths, dtype=np.int32) if self.lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * np.int64(self.dtype.itemsize), out=pointers[1:])
        with open(self.tmp + ".idx", "wb") as f:
            f.write(HEADER + struct.pack("<QBQQ", VERSION, CODES[self.dtype.newbyteorder("=")], len(lengths),
                                         len(lengths) + 1))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())
        if os.path.exists(idx_path(self.prefix)):  # an older pair: never an index beside a .bin it does not fit
            os.remove(idx_path(self.prefix))
        os.replace(self.tmp + ".bin", bin_path(self.prefix))
        os.replace(self.tmp + ".idx", idx_path(self.prefix))  # last: the pair is complete

    def abort(self) -> None:
        self.file.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(self.tmp + suffix):
                os.remove(self.tmp + suffix)
