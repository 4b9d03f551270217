"""The greedy sample a finished run prints (`--no-sample` skips it): SAMPLE_TOKENS tokens after a fixed prompt, so
a new user sees what the model learned.

Every rank takes part, whatever the split: each new token is one forward of the whole (padded) sequence through the
pipeline's virtual stages in order (hidden states sent over the pp group, as the schedules do), the last stage's
argmax broadcast to the pipeline; tp, cp, dp replicas and FSDP2 shards work as in evaluation. No KV cache (that is
GPT.generate's, for a whole model on one rank): a few dozen short forwards.
"""
import math

import torch
import torch.distributed as dist

from tp.collectives import irecv, isend

from ..config import GPTConfig
from ..generation import Text
from ..gpt import GPT

PROMPT = "def "  # the bundled corpus is Python source
SAMPLE_TOKENS = 32


def _length(config: GPTConfig, wanted: int, tp_size: int, cp_size: int) -> int:
    """The padded sequence length the stages can take (SP splits it over tp, cp over 2·cp), at most max_seq_len."""
    unit = (tp_size if config.sequence_parallel else 1) * (2 * cp_size if cp_size > 1 else 1)
    return min(math.ceil(wanted / unit) * unit, config.max_seq_len // unit * unit)


@torch.no_grad()
def _forward(chunks, mesh, tokens, dtype):
    """The logits [1, L, V] of `tokens` [1, L] on the last virtual stage's rank (None elsewhere)."""
    p, count = mesh.pp_size, len(chunks)
    ranks, out = mesh.ranks("pp"), None
    for v in range(p * count):
        owner, chunk = v % p, chunks[v // p]
        if owner != mesh.pp_rank:
            continue
        x = None
        if v > 0:
            if (v - 1) % p == owner:
                x = out
            else:
                x = torch.empty(chunk.activation_shape(1, tokens.shape[1]), dtype=dtype, device=tokens.device)
                irecv(x, ranks[(v - 1) % p], group=mesh.pp_group).wait()
        out = chunk(tokens if v == 0 else None, hidden=x)
        if v + 1 < p * count and (v + 1) % p != owner:
            isend(out.contiguous(), ranks[(v + 1) % p], group=mesh.pp_group).wait()
    return out if (p * count - 1) % p == mesh.pp_rank else None


def greedy_sample(chunks: list[GPT], mesh, tokenizer, *, dtype: torch.dtype) -> str:
    """PROMPT and its greedy continuation (collective over every rank; the same text on each)."""
    text, config = Text(tokenizer), chunks[0].config
    ids = text.encode(PROMPT)
    length = _length(config, len(ids) + SAMPLE_TOKENS, mesh.tp_size, mesh.cp_size)
    device = next(chunks[0].parameters()).device
    tokens = torch.zeros(1, length, dtype=torch.long, device=device)
    tokens[0, :len(ids)] = torch.tensor(ids)
    last = mesh.ranks("pp")[(mesh.pp_size * len(chunks) - 1) % mesh.pp_size]
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    shown = PROMPT
    for position in range(len(ids), length):
        logits = _forward(chunks, mesh, tokens, dtype)
        token = logits[0, position - 1].argmax().view(1) if logits is not None else tokens.new_zeros(1)
        if mesh.pp_size > 1:
            dist.broadcast(token, last, group=mesh.pp_group)
        tokens[0, position] = token[0]
        if text.eos is not None and int(token) == text.eos:
            break
        shown += text.more(int(token))
    for c, mode in zip(chunks, modes):
        c.train(mode)
    return shown
