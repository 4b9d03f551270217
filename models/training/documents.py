"""Documents inside the job's windows, found by the end-of-document token (Megatron's gpt_dataset does the same):
a window of seq_len tokens packs the ends and starts of several documents, each ended by its EOD (the tokenizer's
EOS, or a token file's `eos_id`); a token belongs to the document the EODs before it place it in, the EOD to the
document it ends.

    --reset-attention-mask  attention stays inside each document (the model's document_ids); the positions run on
                            across the window unless --reset-position-ids is given too
    --reset-position-ids    positions restart at each document's first token
    --eod-mask-loss         no loss on the token predicted from an EOD (its target set to ignore_index)

A micro-batch becomes (tokens, targets, {"document_ids" and/or "position_ids": [b, s]}), the form the pipeline runner
hands to every stage.
"""
import functools
from collections.abc import Callable

import torch

from ..block import document_positions
from . import data
from . import tokens as token_files
from .config import JobConfig

IGNORE_INDEX = -100  # the loss's ignore_index
FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def eod_id(job: JobConfig) -> int | None:
    """The end-of-document token: the tokenizer's EOS, else a token file's `eos_id`; None (bytes) when neither."""
    tokenizer = data.tokenizer_dir(job)
    if tokenizer:
        return token_files.load_tokenizer(tokenizer).eos_token_id
    path = job.data.path
    if path is not None and path.endswith(".bin"):
        return token_files.read_header(path).get("eos_id")
    return None


def check(job: JobConfig) -> None:
    """One line if a document flag is given but the data has no end-of-document token to find documents by."""
    given = [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(job.data, f)]
    if given and eod_id(job) is None:
        raise ValueError(f"{' '.join(given)}: documents are found by an end-of-document token, and "
                         f"{job.data.path or 'the bundled corpus'} as bytes has none: give --tokenizer DIR (its EOS "
                         "ends each document) or a token file whose sidecar names eos_id")


def window_inputs(tokens: torch.Tensor, targets: torch.Tensor, *, eod: int, reset_position_ids: bool,
                  reset_attention_mask: bool,
                  eod_mask_loss: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(tokens, targets, inputs) of a micro-batch of windows [b, s]: document ids counted by the EODs before each
    token, and the flags' model inputs and loss mask."""
    ends = tokens == eod
    documents = ends.long().cumsum(1) - ends.long()  # the EODs strictly before each token
    inputs = {}
    if reset_attention_mask:
        inputs["document_ids"] = documents  # (the model restarts the positions itself)
        if not reset_position_ids:
            inputs["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    elif reset_position_ids:
        inputs["position_ids"] = document_positions(documents)
    if eod_mask_loss:
        targets = targets.masked_fill(ends, IGNORE_INDEX)
    return tokens, targets, inputs


def from_job(job: JobConfig) -> Callable | None:
    """window_inputs with the job's EOD and flags, or None when no document flag is given."""
    flags = {f: getattr(job.data, f) for f in FLAGS}
    if not any(flags.values()):
        return None
    return functools.partial(window_inputs, eod=eod_id(job), **flags)
