"""Chat data for supervised fine-tuning (--sft): rows with "messages" ([{"role": ..., "content": ...}, ...]) rendered
by the tokenizer's chat template, only the assistant's tokens in the loss.

The assistant's tokens are those a template marks with `{% generation %}` (transformers'
`return_assistant_tokens_mask`); for a template without it, those between the conversation rendered up to the turn
(with the generation prompt) and rendered through it, located in the whole conversation's tokens by their
characters. Each conversation is ended by the tokenizer's EOS (outside the loss) and stored as one sequence of a
Megatron indexed dataset PREFIX, its loss mask (uint8, 1: in the loss) as a second one, PREFIX_loss_mask.

Conversations are packed whole into windows of seq_len + 1 tokens, in order, a window's rest padded with EOS outside
the loss: a window holds at least one assistant token to learn from. A conversation longer than a window is left
out, never truncated, and counted in a note.
"""
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100  # the loss's ignore_index: targets outside the loss
MASK_SUFFIX = "_loss_mask"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_template(tokenizer: Any, directory: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--tokenizer {directory} has no chat template: --sft renders each row's messages with it")


def check_messages(messages: Any, where: str) -> None:
    """One line unless `messages` is a list of {"role": str, "content": str} with an assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"--data {where}: \"messages\" is not a list of {{\"role\", \"content\"}} turns")
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or \
                not isinstance(turn.get("content"), str):
            raise ValueError(f"--data {where}: a turn of \"messages\" is not {{\"role\": str, \"content\": str}}: "
                             f"{str(turn)[:80]}")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise ValueError(f"--data {where}: no assistant turn in \"messages\" (--sft learns the assistant's tokens)")


def render(tokenizer: Any, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask: 1 on the assistant's tokens) of one conversation, ended by EOS (mask 0)."""
    import jinja2  # (transformers' own dependency, for its chat templates)

    check_messages(messages, where)
    try:
        if _GENERATION.search(tokenizer.chat_template):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, mask = _render_by_prefixes(tokenizer, messages, where)
    except (ValueError, TypeError, LookupError, jinja2.TemplateError) as e:  # e.g. a template's raise_exception
        if str(e).startswith("--data "):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--data {where}: the chat template refused the conversation: {first}") from None
    if not any(mask):
        raise ValueError(f"--data {where}: the chat template rendered no assistant token")
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids, mask = ids + [tokenizer.eos_token_id], mask + [0]
    return ids, [int(bool(m)) for m in mask]


def _render_by_prefixes(tokenizer, messages, where):
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise ValueError(f"--data {where}: the chat template does not render turn {i + 1} as a prefix of the "
                             "conversation, so its assistant tokens cannot be told apart (a template marking them "
                             "with {% generation %} can)")
        spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


# ---- packing -------------------------------------------------------------------------------------------------------


def pack(lengths: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Conversations (sequence `lengths`, back to back in the token stream) packed whole, in order, into windows of
    at most `window` tokens: (window starts, window ends, as token offsets; conversations left out as too long)."""
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()
    starts, ends, too_long, start = [], [], 0, None
    for i, length in enumerate(lengths.tolist()):
        if start is not None and (length > window or offsets[i + 1] - start > window):
            starts.append(start)  # the open window is full (or a left-out conversation interrupts it)
            ends.append(offsets[i])
            start = None
        if length > window:
            too_long += 1
        elif start is None:
            start = offsets[i]
    if start is not None:
        starts.append(start)
        ends.append(offsets[-1])
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64), too_long


class ChatWindows(Dataset):
    """Packed conversations: window i is (input [seq_len], target [seq_len]), the target the next token where it is
    the assistant's, else IGNORE_INDEX; the window's rest padded with `pad_id`."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, starts: Sequence[int], ends: Sequence[int], seq_len: int,
                 pad_id: int):
        self.tokens, self.mask, self.starts, self.ends = tokens, mask, starts, ends
        self.seq_len, self.pad_id = seq_len, pad_id

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        start, end = int(self.starts[i]), int(self.ends[i])
        window = torch.full((self.seq_len + 1,), self.pad_id, dtype=torch.int64)
        learn = torch.zeros(self.seq_len + 1, dtype=torch.bool)
        window[:end - start] = torch.from_numpy(np.asarray(self.tokens[start:end], dtype=np.int64))
        learn[:end - start] = torch.from_numpy(np.asarray(self.mask[start:end], dtype=bool))
        return window[:-1], window[1:].masked_fill(~learn[1:], IGNORE_INDEX)

    def split(self, held: int) -> tuple["ChatWindows", "ChatWindows"]:
        """(the first len - held windows, the last `held`)."""
        n = len(self) - held
        make = lambda a, b: ChatWindows(self.tokens, self.mask, a, b, self.seq_len, self.pad_id)
        return make(self.starts[:n], self.ends[:n]), make(self.starts[n:], self.ends[n:])
