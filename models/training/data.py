"""Training data: the bundled corpus (byte tokens of Python's own standard-library sources, no downloads) or a
user's `--data` (text, a directory of .txt/.jsonl, or a token file; tokens.py), tokenized with `--tokenizer`.

Every rank reads the same token stream. The last ~1% of its windows are held out for validation, never trained on.
`batches` hands each data-parallel rank its slice of every global batch with DistributedSampler's semantics (a
seeded permutation of the training windows, rank r taking positions r, r + dp, ...), so the global batch of a step is
the same set of sequences for any tp x pp x dp split; `eval_batches` walks the held-out windows in order.
"""
import inspect
import itertools
import math
import os
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from . import tokens as token_files
from .config import JobConfig

# Plain-text modules present in every CPython install; ~1 MB of bytes.
_MODULES = ("argparse", "textwrap", "json.decoder", "json.encoder", "string", "difflib", "pprint", "calendar",
            "fractions", "statistics", "shlex", "csv", "configparser", "heapq", "bisect", "functools")
VOCAB_SIZE = 256  # bytes
HOLDOUT = 0.01  # the fraction of token windows held out for validation
Tokens = torch.Tensor | np.ndarray  # a token stream: the corpus in memory, or a token file's memmap
MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [mb, s], targets [mb, s])


def corpus_text() -> str:
    return "\n\n".join(inspect.getsource(__import__(name, fromlist=["_"])) for name in _MODULES)


def corpus() -> torch.Tensor:
    """uint8 tokens of the standard-library sources above, concatenated."""
    return torch.frombuffer(bytearray(corpus_text().encode("utf-8")), dtype=torch.uint8)


# ---- where the tokens come from ------------------------------------------------------------------------------------


def tokenizer_dir(job: JobConfig) -> str | None:
    """--tokenizer, else a --from-hf directory's own tokenizer when it has one, else None (bytes)."""
    from_hf = job.model.from_hf
    if job.data.tokenizer:
        return job.data.tokenizer
    if from_hf and os.path.isdir(from_hf) and token_files.has_tokenizer(from_hf):
        return from_hf
    return None


def _is_token_file(path):
    return path.endswith(".bin")


def check_source(job: JobConfig) -> None:
    """The --data/--tokenizer checks that read no data (one line naming the bad value)."""
    path = job.data.path
    if path is not None:
        if not os.path.exists(path):
            hint = f" (a token file? {path}.bin)" if os.path.isfile(path + ".bin") else ""
            raise ValueError(f"--data {path}: no such file or directory{hint}")
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise ValueError(f"--data {path} is empty")
        if os.path.isdir(path):
            files = token_files.text_files(path)
            if not files:
                raise ValueError(f"--data {path} holds no .txt or .jsonl files")
            if not any(os.path.getsize(f) for f in files):
                raise ValueError(f"--data {path}: its {len(files)} .txt/.jsonl file(s) are all empty")
        elif _is_token_file(path):
            token_files.read_header(path)
    if tokenizer_dir(job):
        token_files.load_tokenizer(tokenizer_dir(job))


def vocab_size(job: JobConfig) -> int | None:
    """The vocabulary the data's ids need: the tokenizer's (and a token file's, if larger), a token file's, 256
    for a user's text as bytes; None for the bundled corpus as bytes (the model keeps its own)."""
    path = job.data.path
    from_file = token_files.read_header(path)["vocab_size"] if path and _is_token_file(path) else 0
    if tokenizer_dir(job):
        return max(from_file, token_files.tokenizer_vocab_size(token_files.load_tokenizer(tokenizer_dir(job))))
    if path is None:
        return None
    return from_file or VOCAB_SIZE


def check_vocab(job: JobConfig, model_vocab: int) -> None:
    """One line if the data's ids do not fit a model of `model_vocab` tokens (a --from-hf model's is fixed)."""
    needed, path = vocab_size(job) or VOCAB_SIZE, job.data.path
    if needed <= model_vocab:
        return
    if path is not None and _is_token_file(path) and token_files.read_header(path)["vocab_size"] == needed:
        raise ValueError(f"--data {path} has vocab_size={needed} in its sidecar, more than the model's "
                         f"vocab_size={model_vocab}")
    if tokenizer_dir(job):
        what = f"--tokenizer {job.data.tokenizer}" if job.data.tokenizer else \
            f"the tokenizer of --from-hf {job.model.from_hf}"
        raise ValueError(f"{what} has {needed} tokens, more than the model's vocab_size={model_vocab}")
    raise ValueError(f"vocab_size={model_vocab} cannot hold the {VOCAB_SIZE} byte tokens")


def _cache_root():
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tp-layers")


def _bundled_text_file():
    """The bundled corpus written as a text file (for a tokenizer to read), rewritten only when it changed."""
    text = corpus_text()
    path = os.path.join(_cache_root(), "corpus", "stdlib.txt")
    if not os.path.isfile(path) or _read(path) != text:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.tmp{os.getpid()}", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(f"{path}.tmp{os.getpid()}", path)
    return path


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def token_path(job: JobConfig, *, build: bool = True, progress: bool = True) -> str | None:
    """The token file the run reads (None: the bundled corpus as bytes, in memory); a text source is tokenized into
    its cache file first if `build` and it is missing (else None is returned for it)."""
    tokenizer, data = tokenizer_dir(job), job.data.path
    if data is not None and _is_token_file(data):
        return os.path.abspath(data)
    if data is None and tokenizer is None:
        return None
    text = data if data is not None else _bundled_text_file()
    path = token_files.cached_path(text, tokenizer)
    if not os.path.isfile(token_files.sidecar(path)):
        if not build:
            return None
        token_files.build(text, tokenizer, path, progress=progress)
    return path


def load(path: str | None) -> Tokens:
    """The token stream: a memmap of token file `path`, or the bundled corpus (path None)."""
    return corpus() if path is None else token_files.read(path)[0]


def token_count(job: JobConfig) -> int | None:
    """Tokens of the run's data if known without reading a user's text (the bundled corpus as bytes, a token
    file), else None: every rank validates, and hashing the text to find its cache is rank 0's job."""
    path = job.data.path
    if path is None and tokenizer_dir(job) is None:
        return len(corpus_text().encode("utf-8"))
    if path is not None and _is_token_file(path):
        return token_files.read_header(path)["count"]
    return None


def check_size(job: JobConfig, num_tokens: int) -> None:
    """One line if `num_tokens` tokens leave fewer training windows than one global batch."""
    global_batch_size, seq_len = job.training.global_batch_size, job.training.seq_len
    train, held, _ = split_sizes(num_tokens, seq_len)
    if global_batch_size > train:
        what = job.data.path or "the corpus"
        raise ValueError(f"--global-batch-size={global_batch_size} exceeds the {max(train, 0)} sequences of "
                         f"--seq-len={seq_len} in {what} left for training ({held} held out for validation)")


def prepare(job: JobConfig) -> None:
    """The launcher's part, before any rank starts: tokenize a user's text into its cache once (a progress bar on a
    terminal), then check it fills a global batch."""
    path = token_path(job)
    check_size(job, len(load(path)))


def shared_tokens(job: JobConfig, group: dist.ProcessGroup | None = None) -> Tokens:
    """On every rank of a process group: rank 0 finds (or builds) the token file, the others read the file it names
    (one builder, never every rank racing)."""
    holder = [token_path(job) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(holder, group_src=0, group=group)
    return load(holder[0])


# ---- windows, splits, batches ------------------------------------------------------------------------------------


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens of `tokens[start:]` (a tensor or a numpy memmap): (input
    [seq_len], target [seq_len]) shifted by one; `count` windows (default: as many as fit)."""

    def __init__(self, tokens: Tokens, seq_len: int, *, start: int = 0, count: int | None = None):
        self.tokens = tokens.long() if isinstance(tokens, torch.Tensor) else tokens
        self.seq_len, self.start = seq_len, start
        fit = (len(tokens) - start - 1) // seq_len
        self.count = fit if count is None else min(count, fit)
        if self.count < 1:
            raise ValueError(f"seq_len={seq_len} is longer than the corpus ({len(tokens) - start} tokens)")

    def __len__(self):
        return self.count

    def span(self, i: int) -> tuple[int, int]:
        """The token positions [first, last + 1) window i reads."""
        first = self.start + i * self.seq_len
        return first, first + self.seq_len + 1

    def __getitem__(self, i):
        window = self.tokens[slice(*self.span(i))]
        if not isinstance(window, torch.Tensor):
            window = torch.from_numpy(np.asarray(window, dtype=np.int64))
        return window[:-1], window[1:]


def split_sizes(num_tokens: int, seq_len: int) -> tuple[int, int, int]:
    """(training windows, held-out windows, first held-out token): the last ~1% of the windows held out, starting
    one token after the last training window ends, so no held-out token is ever read in training (not even as a
    target)."""
    total = (num_tokens - 1) // seq_len
    held = max(1, math.ceil(total * HOLDOUT))
    train = total - held
    while train > 0 and (num_tokens - (train * seq_len + 1) - 1) // seq_len < held:
        train -= 1
    return train, held, train * seq_len + 1


def split(tokens: Tokens, seq_len: int) -> tuple[TokenWindows, TokenWindows]:
    """(training windows, held-out windows) of a token stream."""
    train, held, first = split_sizes(len(tokens), seq_len)
    if train < 1:
        raise ValueError(f"seq_len={seq_len}: the corpus's {len(tokens)} tokens make too few windows to hold "
                         "~1% out for validation")
    return TokenWindows(tokens, seq_len, count=train), TokenWindows(tokens, seq_len, start=first, count=held)


def _micro_batches(dataset, indices, micro_batch_size):
    samples = [dataset[i] for i in indices]
    tokens = torch.stack([x for x, _ in samples])
    targets = torch.stack([y for _, y in samples])
    return list(zip(tokens.split(micro_batch_size), targets.split(micro_batch_size)))


def batches(dataset: TokenWindows, *, dp: int, dp_rank: int, global_batch_size: int, micro_batch_size: int, seed: int,
            start_step: int = 0) -> Iterator[list[MicroBatch]]:
    """Yield, per optimizer step, this dp rank's micro-batches [(tokens [mb, s], targets [mb, s]), ...], forever
    (a new permutation each epoch), starting at `start_step` (resuming)."""
    per_rank = global_batch_size // dp
    steps_per_epoch = len(dataset) // global_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"global batch {global_batch_size} exceeds the {len(dataset)} sequences of the corpus")
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=True, seed=seed, drop_last=True)
    order_epoch, order = None, None
    for step in itertools.count(start_step):
        epoch, position = divmod(step, steps_per_epoch)
        if epoch != order_epoch:  # one permutation per epoch (O(windows)), not per step
            sampler.set_epoch(epoch)
            order_epoch, order = epoch, list(sampler)
        yield _micro_batches(dataset, order[position * per_rank:(position + 1) * per_rank], micro_batch_size)


def eval_batches(held_out: TokenWindows, *, dp: int, dp_rank: int, global_batch_size: int, micro_batch_size: int,
                 iters: int) -> list[list[MicroBatch]]:
    """This dp rank's micro-batches of `iters` global validation batches: the held-out windows in order (wrapping
    round when they run out, as Megatron's validation iterator does), rank r taking positions r, r + dp, ..."""
    n = len(held_out)
    return [_micro_batches(held_out, [(j * global_batch_size + i) % n for i in range(dp_rank, global_batch_size, dp)],
                           micro_batch_size) for j in range(iters)]
