"""Shared test helpers: deterministic per-rank data, collective counting, dense comparisons, greedy margins."""
import math

import torch
from torch.distributed.tensor.debug import CommDebugMode

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"
ALL_TO_ALL = "all_to_all"
_C10D_OPS = {ALL_REDUCE: torch.ops.c10d.allreduce_, ALL_GATHER: torch.ops.c10d._allgather_base_,
             REDUCE_SCATTER: torch.ops.c10d._reduce_scatter_base_, ALL_TO_ALL: torch.ops.c10d.alltoall_base_}


def rng(seed: int) -> torch.Generator:
    """A generator on the default device (the CPU; a GPU under TP_TEST_DEVICE=cuda, where a CPU generator cannot
    draw a tensor on the default device): the same numbers on every rank."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def randn(*shape, seed, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU so every backend sees the same numbers
    x = torch.randn(*shape, generator=g, dtype=dtype, device="cpu").to(torch.get_default_device())
    return x.requires_grad_(requires_grad)


def noncontiguous(x):
    """The same values as x in a non-contiguous layout (a transposed copy, transposed back)."""
    y = x.detach().transpose(0, -1).contiguous().transpose(0, -1)
    assert not y.is_contiguous() or x.dim() < 2 or x.shape[0] == 1 or x.shape[-1] == 1
    return y.requires_grad_(x.requires_grad)


def counts(mode, ops=(ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)):
    """{op: count} of `ops` (all_reduce, all_gather, reduce_scatter by default; all_to_all) recorded by a
    CommDebugMode, and the total of every collective."""
    c = mode.get_comm_counts()
    return {name: c[_C10D_OPS[name]] for name in ops} | {"total": mode.get_total_counts()}


def comm_counts(fn, ops=(ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)):
    """Run fn() under CommDebugMode and return (fn's result, counts of `ops`)."""
    with CommDebugMode() as mode:
        out = fn()
    return out, counts(mode, ops)


def assert_same_safetensors(source, target):
    """The model.safetensors of two save_pretrained directories hold the same names and bit-equal tensors."""
    from safetensors.torch import load_file

    original, written = (load_file(f"{path}/model.safetensors") for path in (source, target))
    assert set(written) == set(original), set(original) ^ set(written)
    for name, tensor in written.items():
        assert torch.equal(tensor, original[name]), name


def assert_close(actual, expected, atol=1e-5, what=""):
    assert actual is not None, f"{what}: missing"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= atol, f"{what}: max abs err {err:.3g} > {atol}"


# Greedy decoding is discrete: two fp32 computations of the logits (ours and Hugging Face's, a split and the dense
# model, the KV cache and the full forward, another machine's kernels) differ by rounding, and a step whose two best
# logits are closer than that can choose either. The tests bound those differences (1e-4, 1e-5 for the cache; ~1e-6
# measured) and assert each greedy step's lead is at least GREEDY_MARGIN, more than twice their sum: both computations
# then choose every token alike, on any machine.
GREEDY_MARGIN = 1e-3

# The tiny 3-step job the launch tests reproduce. Its single-agent curve at tp 2 x dp 2 (SINGLE_AGENT) is run once per
# session (tests/conftest.py's single_agent_run): tests/test_launch.py's two torchrun agents and tests/test_slurm.py's
# sbatch scripts each train it bit for bit.
TINY_JOB = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2", "--seed", "7",
            "--steps", "3", "--log-interval", "1"]
SINGLE_AGENT = [*TINY_JOB, "--tp", "2", "--pp", "1", "--dp", "2"]


def greedy_margin(logits, chosen, eos=None):
    """The smallest lead of the chosen token's logit over the best other one, over greedy steps: `logits` [b, n, V]
    those each of n steps chose from, `chosen` [b, n] its tokens; negative where another token leads. The steps after
    a sequence chose `eos` are padding, not choices: left out."""
    steps, chosen = logits.detach().double(), chosen.to(logits.device)
    lead = steps.gather(-1, chosen[..., None]).squeeze(-1) - steps.scatter(-1, chosen[..., None], -math.inf).amax(-1)
    if eos is not None:
        is_eos = chosen == eos
        lead = lead[is_eos.cumsum(-1) - is_eos.long() == 0]  # (no eos chosen before)
    return lead.min().item()


def build_tokenizer(path, text, vocab_size, *, eos="<|endoftext|>", special=(), chat_template=None):
    """A byte-level BPE trained here on `text` (no downloads), saved as a Hugging Face tokenizer directory; `special`
    tokens added whole, `chat_template` (Jinja) set when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos, *special],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, additional_special_tokens=list(special))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return str(path)


def train_refusal(flags, capsys):
    """`python -m models.train FLAGS`, refused in this process (main() returns before any process starts): its exit
    code, stdout and stderr's lines (the subprocess form is checked once, in test_train's end-to-end test)."""
    from models.training.cli import main

    capsys.readouterr()  # (what the test printed before)
    code = main(list(flags))
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


def quiet(err: str) -> str:
    """A bench.plan run's stderr without a long search's progress lines."""
    return "\n".join(line for line in err.splitlines() if not line.startswith("bench.plan: "))
