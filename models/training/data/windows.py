"""Token windows, the held-out split and the batches of every step.

Every rank reads the same token stream. The last ~1% of its windows are held out for validation, never trained on.
`batches` hands each data-parallel rank its micro-batches of every global batch (a seeded permutation of the
training windows, as DistributedSampler's; a blend's draws in order), micro-batch k to dp rank k mod dp, so a step
runs the same micro-batches of the same sequences for any tp x cp x pp x dp split; `eval_batches` walks the held-out
windows in order.
"""
import inspect
import itertools
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from .blend import Blend

# Plain-text modules present in every CPython install (one document each); ~1 MB of bytes.
CORPUS_MODULES = ("argparse", "textwrap", "json.decoder", "json.encoder", "string", "difflib", "pprint",
                  "calendar", "fractions", "statistics", "shlex", "csv", "configparser", "heapq", "bisect",
                  "functools")
VOCAB_SIZE = 256  # bytes
HOLDOUT = 0.01  # the fraction of token windows held out for validation
Tokens = torch.Tensor | np.ndarray  # a token stream: the corpus in memory, or a token file's memmap
MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (tokens [mb, s], targets [mb, s])


def corpus_text() -> str:
    return "\n\n".join(inspect.getsource(__import__(name, fromlist=["_"])) for name in CORPUS_MODULES)


def corpus() -> torch.Tensor:
    """uint8 tokens of the standard-library sources above, concatenated."""
    return torch.frombuffer(bytearray(corpus_text().encode("utf-8")), dtype=torch.uint8)


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


def _micro_batches(dataset, positions, *, dp, dp_rank, micro_batch_size):
    """This dp rank's micro-batches of the global batch at `positions`: micro-batch k is positions [k·mb, (k+1)·mb)
    and runs on dp rank k mod dp, so every split runs the same micro-batches (a loss averaged per micro-batch over
    the tokens in it, as with ignored targets, is then the same at any dp)."""
    out = []
    for k in range(dp_rank * micro_batch_size, len(positions), dp * micro_batch_size):
        samples = [dataset[i] for i in positions[k:k + micro_batch_size]]
        out.append((torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])))
    return out


def batches(dataset: Dataset, *, dp: int, dp_rank: int, global_batch_size: int, micro_batch_size: int, seed: int,
            start_step: int = 0) -> Iterator[list[MicroBatch]]:
    """Yield, per optimizer step, this dp rank's micro-batches [(tokens [mb, s], targets [mb, s]), ...], forever,
    starting at `start_step` (resuming): the global batch of step s is positions [s·B, (s+1)·B) of a seeded
    permutation of the windows, a new one each epoch (DistributedSampler's), or a blend's draws in that range (it
    shuffles each dataset itself)."""
    split = dict(dp=dp, dp_rank=dp_rank, micro_batch_size=micro_batch_size)
    if isinstance(dataset, Blend):
        for step in itertools.count(start_step):
            first = step * global_batch_size
            yield _micro_batches(dataset, range(first, first + global_batch_size), **split)
    steps_per_epoch = len(dataset) // global_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"global batch {global_batch_size} exceeds the {len(dataset)} sequences of the corpus")
    order_epoch, order = None, None
    for step in itertools.count(start_step):
        epoch, position = divmod(step, steps_per_epoch)
        if epoch != order_epoch:  # one permutation per epoch (O(windows)), not per step
            generator = torch.Generator().manual_seed(seed + epoch)  # (DistributedSampler's, at any dp)
            order_epoch, order = epoch, torch.randperm(len(dataset), generator=generator, device="cpu").tolist()
        yield _micro_batches(dataset, order[position * global_batch_size:(position + 1) * global_batch_size], **split)


def eval_batches(held_out: Dataset, *, dp: int, dp_rank: int, global_batch_size: int, micro_batch_size: int,
                 iters: int) -> list[list[MicroBatch]]:
    """This dp rank's micro-batches of `iters` global validation batches: the held-out windows in order (wrapping
    round when they run out, as Megatron's validation iterator does), micro-batches dealt to the dp ranks as in
    `batches`."""
    n = len(held_out)
    return [_micro_batches(held_out, [(j * global_batch_size + i) % n for i in range(global_batch_size)], dp=dp,
                           dp_rank=dp_rank, micro_batch_size=micro_batch_size) for j in range(iters)]
