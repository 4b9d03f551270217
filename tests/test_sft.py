"""Chat fine-tuning (--sft, models/training/data/sft.py): conversations rendered by the tokenizer's chat template,
only the assistant's tokens in the loss (with or without `{% generation %}` in the template: the same mask),
packed whole into windows, a too-long conversation counted and reported, never truncated; the targets reach the
model through the batches (ignore_index -100), a run's curve is the same at pp2 x dp2 as in one process, and bad rows
are one line before any process starts."""
import json
import re

import numpy as np
import pytest
import torch

from models.training import data, tokens
from models.training.cli import job_config, parser, train, validate
from models.training.data import indexed, sft
from tp.testing import distributed, run

from .helpers import build_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
                     "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>"
                     "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat(i):
    turns = [{"role": "system", "content": "You answer briefly."}] if i % 3 == 0 else []
    turns += [{"role": "user", "content": f"What is {i} plus {i}?"},
              {"role": "assistant", "content": f"It is {2 * i}."}]
    if i % 2:  # a second exchange
        turns += [{"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": f"{4 * i}, sir."}]
    return turns


CHATS = [_chat(i) for i in range(120)]


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    text = "\n".join(m["content"] for chat in CHATS for m in chat) + "\nuser assistant system"
    special = ("<|im_start|>", "<|im_end|>")
    return {name: build_tokenizer(root / name, text, 300, special=special, chat_template=template)
            for name, template in (("plain", CHATML), ("generation", CHATML_GENERATION))}


@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat, "id": i}) + "\n" for i, chat in enumerate(CHATS)))
    return str(path)


def _job(*flags):
    return job_config(parser().parse_args(["--tp", "1", "--pp", "1", "--dp", "1", "--sft", *flags]))


def test_only_the_assistants_tokens_are_in_the_mask_with_or_without_generation_marks(tokenizers):
    from transformers import AutoTokenizer

    rendered = {}
    for name, directory in tokenizers.items():
        tok = AutoTokenizer.from_pretrained(directory)
        for chat in CHATS[:6]:
            ids, mask = sft.render(tok, chat, "chats.jsonl line 1")
            assert ids[-1] == tok.eos_token_id and mask[-1] == 0 and len(ids) == len(mask)
            assert tok.decode(ids[:-1]) == tok.apply_chat_template(chat, tokenize=False)
            learned = tok.decode([i for i, m in zip(ids, mask) if m])
            assert learned == "".join(f"{m['content']}<|im_end|>\n" for m in chat if m["role"] == "assistant")
            rendered.setdefault(name, []).append((ids, mask))
    assert rendered["plain"] == rendered["generation"]


def test_conversations_are_packed_whole_and_a_too_long_one_is_left_out_and_counted():
    lengths = np.array([5, 3, 9, 4, 4, 12, 2, 1, 8])
    starts, ends, too_long = sft.pack(lengths, 9)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    assert too_long == 1  # the 12
    assert list(zip(starts.tolist(), ends.tolist())) == [(0, 8), (8, 17), (17, 25), (37, 40), (40, 48)]
    packed = [(a, b) for a, b in zip(starts, ends)]
    for i, length in enumerate(lengths.tolist()):  # each conversation inside one window, or left out if too long
        inside = [w for w in packed if w[0] <= offsets[i] and offsets[i + 1] <= w[1]]
        assert len(inside) == (length <= 9)


def test_windows_carry_targets_only_on_assistant_tokens_into_the_models_loss(tmp_path, tokenizers, chats):
    job = _job("--data", chats, "--tokenizer", tokenizers["plain"], "--seq-len", "48", "--global-batch-size", "4")
    validate(job)
    (prefix,) = data.resolve(job, progress=False)
    index = indexed.read_index(prefix)
    assert index.documents == len(CHATS) and indexed.exists(prefix + sft.MASK_SUFFIX)
    train_windows, held, notes = data.datasets(job, [prefix])
    longest = int(index.lengths.max())
    too_long = int((index.lengths > 49).sum())
    assert too_long > 0 and notes == [f"note: --sft: {too_long} of {len(CHATS)} conversations in {chats} are "
                                      f"longer than --seq-len + 1 = 49 tokens (the longest {longest}): left out, not "
                                      "truncated"]
    assert len(held) == 1 and len(train_windows) >= 30
    kept = index.lengths[index.lengths <= 49]
    (line,) = data.prepare(job)  # what the job prints: the conversations and tokens it trains on, those left out
    assert line.startswith(f"data: {chats} (jsonl): {len(kept)} of {len(CHATS)} conversations ({too_long} longer "
                           f"than --seq-len + 1: left out), {int(kept.sum()):,} tokens; "), line
    tokens_all, mask_all = data.load(prefix), data.load(prefix + sft.MASK_SUFFIX)
    for i in range(len(train_windows)):
        x, y = train_windows[i]
        start, end = int(train_windows.starts[i]), int(train_windows.ends[i])
        n = end - start
        assert x[:n].tolist() == tokens_all[start:end].tolist()[:48][:n]
        learn = mask_all[start + 1:end].astype(bool)
        assert y[:n - 1][torch.from_numpy(learn)].tolist() == tokens_all[start + 1:end][learn].tolist()
        assert (y[:n - 1][torch.from_numpy(~learn)] == -100).all() and (y[n - 1:] == -100).all()  # padding
    (x, y), = next(data.batches(train_windows, dp=1, dp_rank=0, global_batch_size=4, micro_batch_size=4, seed=0))
    loss, expected = run(_losses, 1, x=x, y=y)[0]
    assert abs(loss - expected) <= 1e-6 * expected  # the model's loss: the mean over the assistant's tokens alone


def _losses(x, y):
    """(the GPT's loss on (x, y), cross-entropy of its logits over the targets that are not -100)."""
    import tp
    from models.config import GPTConfig
    from models.gpt import GPT

    tp.init_mesh(tp=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, max_seq_len=48))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        return model(x, y).item(), expected.item()


def test_the_token_cli_writes_the_pair_that_sft_reads_in_place(tmp_path, tokenizers, chats, capsys):
    assert tokens.main(["--data", chats, "--tokenizer", tokenizers["generation"], "--sft", "--out",
                        str(tmp_path / "chat")]) == 0
    assert capsys.readouterr().out.endswith(f"(and its loss mask {tmp_path / 'chat'}_loss_mask)\n")
    job = _job("--data", str(tmp_path / "chat"), "--tokenizer", tokenizers["generation"], "--seq-len", "64",
               "--global-batch-size", "4")
    validate(job)
    assert data.resolve(job) == [str(tmp_path / "chat")]
    (cached,) = data.resolve(_job("--data", chats, "--tokenizer", tokenizers["plain"]), progress=False)
    assert np.array_equal(data.load(str(tmp_path / "chat")), data.load(cached))  # (the same tokens and mask)
    assert np.array_equal(data.load(f"{tmp_path / 'chat'}_loss_mask"), data.load(cached + sft.MASK_SUFFIX))


@pytest.mark.parametrize("case,message", [
    ("no_assistant", r"^--data .*bad.jsonl line 2: no assistant turn in \"messages\" \(--sft learns the assistant's "
                     r"tokens\)$"),
    ("not_turns", r"^--data .*bad.jsonl line 2: a turn of \"messages\" is not \{\"role\": str, \"content\": str\}"),
    ("no_messages", r"^--data .*bad.jsonl line 2: no field \"messages\"$"),
    ("no_template", r"^--tokenizer .*notemplate has no chat template: --sft renders each row's messages with it$"),
    ("template_refuses", r"^--data .*bad.jsonl line 2: the chat template refused the conversation: a conversation "
                         r"starts with the user$"),
    ("no_tokenizer", r"^--sft renders chats with a tokenizer's chat template: give --tokenizer DIR$"),
    ("text", r"^--data .*notes.txt: --sft reads rows with \"messages\" \(.jsonl, parquet, save_to_disk\), not text$"),
    ("all_too_long", r"^--data .*chats.jsonl: each of its 120 conversations is longer than --seq-len \+ 1 = 9 "
                     r"tokens \(the shortest \d+\): nothing to train on; raise --seq-len$"),
])
def test_bad_chat_input_is_one_line_before_any_process(tmp_path, tokenizers, chats, case, message):
    bad = tmp_path / "bad.jsonl"
    second = {"no_assistant": {"messages": [{"role": "user", "content": "hi"}]},
              "not_turns": {"messages": [{"role": "user", "text": "hi"}]},
              "no_messages": {"text": "plain"},
              "template_refuses": {"messages": [{"role": "assistant", "content": "hi"}]}}.get(case, {})
    bad.write_text(json.dumps({"messages": CHATS[0]}) + "\n" + json.dumps(second) + "\n")
    (tmp_path / "notes.txt").write_text("plain text")
    tokenizer = tokenizers["plain"]
    if case in ("no_template", "template_refuses"):
        from transformers import AutoTokenizer

        plain = AutoTokenizer.from_pretrained(tokenizer)
        plain.chat_template = None if case == "no_template" else \
            "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a conversation starts with the user') }}" \
            "{% endif %}" + CHATML
        plain.save_pretrained(tmp_path / "notemplate")
        tokenizer = str(tmp_path / "notemplate")
    flags = {"no_tokenizer": ["--data", str(bad)], "text": ["--data", str(tmp_path / "notes.txt"), "--tokenizer",
                                                              tokenizer],
             "all_too_long": ["--data", chats, "--tokenizer", tokenizer, "--seq-len", "8"]
             }.get(case, ["--data", str(bad), "--tokenizer", tokenizer])
    job = _job("--global-batch-size", "4", *flags)
    with pytest.raises(ValueError) as error:
        validate(job)
        data.prepare(job)  # (the launcher, before any rank: rendering every row)
    assert len(str(error.value).splitlines()) == 1 and re.search(message, str(error.value)), str(error.value)


@distributed(world_size=4, timeout=300)
def _train(flags, log):
    train(parser().parse_args([*flags, "--log-jsonl", log]))


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_an_sft_run_trains_the_same_curve_at_pp2_dp2_as_in_one_process(tmp_path, tokenizers, chats):
    flags = ["--sft", "--data", chats, "--tokenizer", tokenizers["plain"], "--data-cache-dir", str(tmp_path / "c"),
             "--model", "tiny", "--seq-len", "64", "--global-batch-size", "8", "--micro-batch-size", "2",
             "--steps", "3", "--seed", "4", "--eval-every", "3", "--eval-iters", "1"]
    run(_train, 4, timeout=300, flags=[*flags, "--tp", "1", "--pp", "2", "--dp", "2"], log=str(tmp_path / "s.jsonl"))
    run(_train, 1, timeout=300, flags=[*flags, "--tp", "1", "--pp", "1", "--dp", "1"], log=str(tmp_path / "1.jsonl"))
    split, serial = _rows(tmp_path / "s.jsonl"), _rows(tmp_path / "1.jsonl")
    assert [r["step"] for r in split] == [1, 2, 3] and "val_loss" in split[-1]
    for ours, reference in zip(split, serial, strict=True):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in reference:
                assert abs(ours[key] - reference[key]) <= 1e-5 * reference[key], (key, ours, reference)
