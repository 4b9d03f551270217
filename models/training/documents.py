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
from .config import DataConfig

IGNORE_INDEX = -100  # the loss's ignore_index
FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def check(flags: DataConfig, eod: int | None) -> None:
    """One line if a document flag is given but the data has no end-of-document token (`eod`, the data plan's) to
    find documents by."""
    given = [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(flags, f)]
    if given and eod is None:
        source = " ".join(flags.path or ["the bundled corpus"])
        raise ValueError(f"{' '.join(given)}: documents are found by an end-of-document token, and {source} as bytes "
                         "has none: give --tokenizer DIR (its EOS ends each document) or a token file whose sidecar "
                         "names eos_id")


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


def from_flags(flags: DataConfig, eod: int | None) -> Callable | None:
    """window_inputs with the data's EOD and the document flags, or None when no document flag is given."""
    given = {f: getattr(flags, f) for f in FLAGS}
    if not any(given.values()):
        return None
    return functools.partial(window_inputs, eod=eod, **given)
