"""The data plan: a job's data resolved once per process, before any rank starts (preflight.py, the launcher) and on
each rank (trainer.py): every dataset of the blend with its weight and format (formats.py), how they are read (the
tokenizer directory, the column, --sft, the token cache) and the windows the run takes (--seq-len,
--global-batch-size, --seed, --steps). Every data step after it takes the plan, never the job: the checks, the token
files (tokenized where needed), each dataset's windows and what the job found."""
import hashlib
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist
from torch.utils.data import Dataset

from ..config import JobConfig
from ..launch import check_writable_dir
from . import indexed, sources
from .blend import Blend
from .build import default_cache_dir
from .formats import FlatTokens, Format, Indexed, Reading, check_mask, detect
from .sft import ChatWindows, check_template, pack
from .tokenizer import has_tokenizer
from .windows import HOLDOUT, VOCAB_SIZE, Tokens, split, split_sizes

FOUND_FILE = "data.txt"  # what the job found, in the ranks' log directory


@dataclass(frozen=True)
class Source:
    """One dataset of the run: its --data path (None: the bundled corpus), blend weight and format (detected from
    the path when not given)."""

    path: str | None
    weight: float = 1.0
    format: Format = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.format is None:
            object.__setattr__(self, "format", detect(self.path))

    @property
    def kind(self) -> str:
        """Its format's name in FORMATS."""
        return self.format.name

    @property
    def label(self) -> str:
        """Its kind, or for a directory of documents the files it holds by suffix (what the data line says)."""
        if self.kind != "text" or not self.path or not os.path.isdir(self.path):
            return self.kind
        suffixes = Counter(os.path.splitext(f)[1] for f in sources.data_files(self.path))
        counts = [f"{n} {suffix}" for suffix, n in suffixes.most_common()]
        return f"a directory of {' and '.join(counts)} file{'s' * (sum(suffixes.values()) != 1)}"

    @property
    def name(self) -> str:
        return self.path or "the corpus"


@dataclass(frozen=True)
class Opened:
    """One dataset's windows: training, held out; its tokens and documents (None: not indexed); notes to report."""

    source: Source
    train: Dataset
    held: Dataset
    tokens: int
    documents: int | None
    notes: tuple[str, ...] = ()
    left_out: int = 0  # --sft: conversations longer than a window, of `documents`


def _check_null_tokenizer(job: JobConfig) -> None:
    """--tokenizer-type NullTokenizer's flags: --vocab-size N given (its ids), no tokenizer beside it."""
    if job.data.tokenizer:
        raise ValueError(f"--tokenizer-type NullTokenizer with --tokenizer {job.data.tokenizer}: the one reads ids "
                         "without a tokenizer, the other tokenizes: give one")
    if job.checkpoint.use_checkpoint_args:
        raise ValueError("--tokenizer-type NullTokenizer with --use-checkpoint-args: give the model's flags and "
                         "--vocab-size N instead (the checkpoint keeps the padded vocabulary, not N)")
    if job.model.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N (its ids are below N, N ends a "
                         "document)")


@dataclass(frozen=True)
class DataPlan:
    """A job's data, resolved (DataPlan.of). `tokenizer_given` says where the tokenizer came from, for messages."""

    sources: tuple[Source, ...]
    reading: Reading
    tokenizer_given: str | None
    seq_len: int
    global_batch_size: int
    seed: int
    steps: int

    @classmethod
    def of(cls, job: JobConfig) -> "DataPlan":
        """The plan of a job: its --data blend (the bundled corpus without one), each source's format found, and
        its tokenizer: --tokenizer, else a --from-hf directory's own when it has one, else None (bytes)."""
        data, from_hf, training = job.data, job.model.from_hf, job.training
        tokenizer, given, null_vocab = None, None, None
        if data.tokenizer_type == "NullTokenizer":
            _check_null_tokenizer(job)
            null_vocab = job.model.vocab_size
            given = f"--tokenizer-type NullTokenizer --vocab-size {null_vocab}"
        elif data.tokenizer:
            tokenizer, given = data.tokenizer, f"--tokenizer {data.tokenizer}"
        elif data.tokenizer_type == "HuggingFaceTokenizer":
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer DIR (--tokenizer-model)")
        elif from_hf and os.path.isdir(from_hf) and has_tokenizer(from_hf):
            tokenizer, given = from_hf, f"the tokenizer of --from-hf {from_hf}"
        column = data.column or (sources.SFT_COLUMN if data.sft else sources.DEFAULT_COLUMN)
        reading = Reading(tokenizer, column, data.sft, data.cache_dir or default_cache_dir(), null_vocab)
        return cls(tuple(Source(path, weight) for weight, path in data.blend()), reading, given,
                   training.seq_len, training.global_batch_size, training.seed, training.steps)

    @property
    def blended(self) -> bool:
        return len(self.sources) > 1

    def vocab_size(self) -> int | None:
        """The vocabulary the data's ids need: the tokenizer's (and a source's own, if larger), a source's own, 256
        for bytes; None for the bundled corpus as bytes (the model keeps its own)."""
        own = [s.format.vocabulary() for s in self.sources if s.format.vocabulary() is not None]
        if self.reading.null_vocab is not None:  # (ids below N, and N itself: the end of document)
            return max([self.reading.null_vocab + 1, *own])
        if self.reading.tokenizer_dir:
            return max([self.reading.tokenizer_vocab(), *own])
        if all(s.path is None for s in self.sources):
            return None
        return max([VOCAB_SIZE, *own])

    def eod_id(self) -> int | None:
        """The id that ends every document in the token stream: the tokenizer's EOS, else the one the sources that
        name their own vocabulary agree on (a flat token file's `eos_id`); None for bytes (blank lines)."""
        if self.reading.tokenizer_dir is not None:
            return self.reading.tokenizer().eos_token_id
        if self.reading.null_vocab is not None:
            return self.reading.null_vocab
        named = [s.format.eod_id() for s in self.sources if s.format.vocabulary() is not None]
        return named[0] if named and all(n == named[0] for n in named) else None

    # ---- checks before any process -----------------------------------------------------------------------------

    def check(self) -> None:
        """The --data/--tokenizer/--sft checks that read no more than headers, schemas and the start of a text file
        (one line naming the bad value); the token cache writable where a source is tokenized into it."""
        reading = self.reading
        for source in self.sources if reading.null_vocab is not None else ():
            if not isinstance(source.format, (Indexed, FlatTokens)):
                raise ValueError("--tokenizer-type NullTokenizer reads token ids (a Megatron .bin/.idx pair or a flat "
                                 f"token file), not --data {source.path or '(the bundled corpus)'}: text needs "
                                 "--tokenizer DIR")
        if reading.tokenizer_dir:
            tokenizer = reading.tokenizer()
            if reading.sft:
                check_template(tokenizer, reading.tokenizer_dir)
        elif reading.sft:
            raise ValueError("--sft renders chats with a tokenizer's chat template: give --tokenizer DIR")
        for source in self.sources:
            source.format.check(reading)
        if any(s.format.tokenized(reading) for s in self.sources):
            check_writable_dir("--data-cache-dir", reading.cache_dir)

    def check_vocab(self, model_vocab: int) -> None:
        """One line if the data's ids do not fit a model of `model_vocab` tokens (a --from-hf model's is fixed)."""
        needed = self.vocab_size() or VOCAB_SIZE
        if needed <= model_vocab:
            return
        for source in self.sources:
            if source.format.vocabulary() == needed:
                raise ValueError(f"--data {source.path} has vocab_size={needed} in its sidecar, more than the "
                                 f"model's vocab_size={model_vocab}")
        if self.reading.tokenizer_dir or self.reading.null_vocab is not None:
            raise ValueError(f"{self.tokenizer_given} has {needed} tokens, more than the model's "
                             f"vocab_size={model_vocab}")
        raise ValueError(f"vocab_size={model_vocab} cannot hold the {VOCAB_SIZE} byte tokens")

    # ---- token files ---------------------------------------------------------------------------------------------

    def resolve(self, *, build_missing: bool = True, progress: bool = True) -> list[str | None]:
        """Per source, the token file the run reads (None: the bundled corpus as bytes, in memory): its own in
        place, else its token cache PREFIX, tokenized first if missing and `build_missing` (else None for it)."""
        return [s.format.token_file(self.reading, build_missing=build_missing, progress=progress)
                for s in self.sources]

    def verified(self, *, progress: bool) -> list[str | None]:
        """The token files, built where missing, a user's own token files' ids checked against the vocabulary."""
        resolved = self.resolve(progress=progress)
        vocab = self.vocab_size()
        for source, token_file in zip(self.sources, resolved):
            if token_file is not None and not source.format.tokenized(self.reading) and vocab is not None:
                self.check_ids(token_file, source.format.open(token_file), vocab)
        return resolved

    def check_ids(self, token_file: str, tokens: Tokens, vocab: int) -> None:
        """One line if a token file a user gave (its `tokens`) holds an id outside [0, vocab) (scanned once per file
        version: a marker in the cache remembers it)."""
        if np.iinfo(tokens.dtype).max < vocab and np.iinfo(tokens.dtype).min >= 0:
            return
        stat = os.stat(indexed.bin_path(token_file) if indexed.exists(token_file) else token_file)
        key = f"{os.path.abspath(token_file)}\0{stat.st_size}\0{stat.st_mtime_ns}\0{vocab}"
        marker = os.path.join(self.reading.cache_dir, "checked", hashlib.sha256(key.encode()).hexdigest()[:16])
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
                                 f"{vocab} ids{f' of {self.tokenizer_given}' if self.tokenizer_given else ''}")
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            open(marker, "w").close()
        except OSError:  # (a cache that cannot be written: scanned again next time)
            pass

    # ---- windows -------------------------------------------------------------------------------------------------

    def check_sizes(self, resolved: list[str | None] | None = None) -> list[str]:
        """One line if a dataset makes too few windows (fewer training windows than a global batch, for one dataset;
        none to train on or hold out, for a blend's); checks the datasets whose tokens are known without tokenizing,
        all of them given their `resolved` token files. Returns the notes to report (too-long conversations)."""
        if resolved is not None:
            return [note for opened in self.opened(resolved) for note in opened.notes]
        return [note for source in self.sources if not source.format.tokenized(self.reading)  # (text: once tokenized)
                for note in self.open(source, source.format.token_file(self.reading)).notes]

    def open(self, source: Source, token_file: str | None) -> Opened:
        """One source's token file opened into windows (its last ~1% held out; --sft: packed conversations)."""
        tokens, seq_len = source.format.open(token_file), self.seq_len
        documents = source.format.documents(token_file)
        if not self.reading.sft:
            train, held, _ = split_sizes(len(tokens), seq_len)
            if train < 1:
                raise ValueError(f"--data {source.name} has {len(tokens):,} tokens: one sequence of --seq-len="
                                 f"{seq_len} to train on and one held out for validation need {2 * seq_len + 2}; "
                                 "lower --seq-len or give more data")
            if not self.blended and self.global_batch_size > train:
                raise ValueError(self.too_small(source, train, held))
            return Opened(source, *split(tokens, seq_len), len(tokens), documents)
        index = indexed.read_index(token_file)
        mask = indexed.read_tokens(check_mask(token_file, index))
        starts, ends, too_long = pack(index.lengths, seq_len + 1)
        if too_long == len(index.lengths):
            raise ValueError(f"--data {source.name}: each of its {too_long} conversations is longer than --seq-len + 1 "
                             f"= {seq_len + 1} tokens (the shortest {int(index.lengths.min())}): nothing to train on; "
                             "raise --seq-len")
        notes = (f"note: --sft: {too_long} of {len(index.lengths)} conversations in {source.name} are longer than "
                 f"--seq-len + 1 = {seq_len + 1} tokens (the longest {int(index.lengths.max())}): left out, not "
                 "truncated",) if too_long else ()
        windows = ChatWindows(tokens, mask, starts, ends, seq_len, self.reading.tokenizer().eos_token_id)
        held = max(1, math.ceil(len(windows) * HOLDOUT))
        if len(windows) - held < 1 or (not self.blended and self.global_batch_size > len(windows) - held):
            raise ValueError(self.too_small(source, max(0, len(windows) - held), held, chats=len(index.lengths)))
        kept_tokens = int(index.lengths[index.lengths <= seq_len + 1].sum())
        return Opened(source, *windows.split(held), kept_tokens, documents, notes, left_out=too_long)

    def too_small(self, source: Source, train: int, held: int, chats: int | None = None) -> str:
        what = f"windows of packed conversations ({chats} of them)" if chats is not None else "sequences"
        if self.blended:
            return f"--data {source.name} makes {train} {what} of --seq-len={self.seq_len} to train on " \
                   f"(and {held} held out): too few for a blend"
        return f"--global-batch-size={self.global_batch_size} exceeds the {train} {what} of " \
               f"--seq-len={self.seq_len} in {source.name} left for training ({held} held out for validation)"

    def opened(self, resolved: list[str | None]) -> list[Opened]:
        return [self.open(source, token_file) for source, token_file in zip(self.sources, resolved)]

    def windows(self, opened: list[Opened]) -> tuple[Dataset, Dataset]:
        """(training windows, held-out windows) of the run: one dataset's, or a Blend of each dataset's (seeded by
        --seed; the held-out blend in order)."""
        if len(opened) == 1:
            return opened[0].train, opened[0].held
        weights = [o.source.weight for o in opened]
        return (Blend([o.train for o in opened], weights, seed=self.seed),
                Blend([o.held for o in opened], weights, seed=None))

    def datasets(self, resolved: list[str | None]) -> tuple[Dataset, Dataset, list[str]]:
        """(training windows, held-out windows, notes) of the run's `resolved` token files."""
        opened = self.opened(resolved)
        return (*self.windows(opened), [note for o in opened for note in o.notes])

    def found(self, opened: list[Opened]) -> list[str]:
        """What the job found, a line per dataset: its documents, tokens, share of the blend and the epochs of its
        training windows that --steps take."""
        total = sum(s.weight for s in self.sources)
        lines = []
        for o in opened:
            share = o.source.weight / total
            epochs = self.steps * self.global_batch_size * share / len(o.train) if self.blended else \
                self.steps / (len(o.train) // self.global_batch_size)  # (whole global batches per epoch: batches())
            if o.documents is None:
                documents = "no document index"
            elif self.reading.sft:  # (the tokens: the conversations it trains on)
                documents = f"{o.documents - o.left_out:,} of {o.documents:,} conversations ({o.left_out:,} longer " \
                            "than --seq-len + 1: left out)" if o.left_out else f"{o.documents:,} conversations"
            else:
                documents = f"{o.documents:,} document{'s' * (o.documents != 1)}"
            lines.append(f"data: {o.source.name} ({o.source.label}): {documents}, {o.tokens:,} tokens"
                         + (f", {share:.1%} of the blend" if self.blended else "")
                         + f"; {self.steps} steps take {epochs:.3g} epochs of its {len(o.train):,} training windows")
        return lines

    # ---- the launcher's part, and each rank's -------------------------------------------------------------------

    def prepare(self) -> list[str]:
        """The launcher's part, before any rank starts: tokenize a user's text into its cache once (a progress bar on
        a terminal), check a user's token files' ids, then that every dataset fills its windows; print what the job
        found (and return those lines)."""
        lines = self.found(self.opened(self.verified(progress=True)))
        print("\n".join(lines), flush=True)
        return lines

    def shared_datasets(self, group: dist.ProcessGroup | None = None, *,
                        log_dir: str | None = None) -> tuple[Dataset, Dataset]:
        """(training windows, held-out windows) on every rank of a process group: rank 0 finds (or builds) the token
        files and checks them, the others read the files it names (one builder, never every rank racing); an error
        is raised on every rank, a note printed by rank 0, which writes what the job found to LOG_DIR/data.txt."""
        holder = [None]
        if dist.get_rank(group) == 0:
            try:
                holder = [("ok", self.verified(progress=False))]
            except (ValueError, OSError) as e:  # every rank raises it, none left waiting
                holder = [("error", str(e))]
        dist.broadcast_object_list(holder, group_src=0, group=group)
        status, value = holder[0]
        if status == "error":
            raise ValueError(value)
        opened = self.opened(value)
        if dist.get_rank(group) == 0:
            notes = [note for o in opened for note in o.notes]
            if notes:
                print("\n".join(notes), file=sys.stderr, flush=True)
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
                with open(os.path.join(log_dir, FOUND_FILE), "w") as f:
                    f.write("".join(f"{line}\n" for line in self.found(opened)))
        return self.windows(opened)

