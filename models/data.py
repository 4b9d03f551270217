"""Training data built locally (no downloads): byte-level tokens of Python's own standard-library sources.

Every rank builds the same token stream from the interpreter it runs on. `batches` hands each data-parallel rank its
slice of every global batch with DistributedSampler's semantics (a seeded permutation of the samples, rank r taking
positions r, r + dp, ...), so the global batch of a step is the same set of sequences for any tp x pp x dp split.
"""
import inspect
import itertools

import torch
from torch.utils.data import Dataset, DistributedSampler

# Plain-text modules present in every CPython install; ~1 MB of bytes.
_MODULES = ("argparse", "textwrap", "json.decoder", "json.encoder", "string", "difflib", "pprint", "calendar",
            "fractions", "statistics", "shlex", "csv", "configparser", "heapq", "bisect", "functools")
VOCAB_SIZE = 256  # bytes


def corpus():
    """uint8 tokens of the standard-library sources above, concatenated."""
    text = "\n\n".join(inspect.getsource(__import__(name, fromlist=["_"])) for name in _MODULES)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens: (input [seq_len], target [seq_len]) shifted by one."""

    def __init__(self, tokens, seq_len):
        self.tokens, self.seq_len = tokens.long(), seq_len
        self.count = (len(tokens) - 1) // seq_len
        if self.count < 1:
            raise ValueError(f"seq_len={seq_len} is longer than the corpus ({len(tokens)} tokens)")

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        window = self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def batches(dataset, *, dp, dp_rank, global_batch_size, micro_batch_size, seed, start_step=0):
    """Yield, per optimizer step, this dp rank's micro-batches [(tokens [mb, s], targets [mb, s]), ...], forever
    (a new permutation each epoch), starting at `start_step` (resuming)."""
    per_rank = global_batch_size // dp
    steps_per_epoch = len(dataset) // global_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"global batch {global_batch_size} exceeds the {len(dataset)} sequences of the corpus")
    for step in itertools.count(start_step):
        epoch, position = divmod(step, steps_per_epoch)
        sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        indices = list(sampler)[position * per_rank:(position + 1) * per_rank]
        samples = [dataset[i] for i in indices]
        tokens = torch.stack([x for x, _ in samples])
        targets = torch.stack([y for _, y in samples])
        yield list(zip(tokens.split(micro_batch_size), targets.split(micro_batch_size)))
