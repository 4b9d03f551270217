"""Text from a trained model: `python -m models.generate`, greedy or sampled, streamed to the terminal.

    python -m models.generate --load ckpt --prompt "def main("                     # a training checkpoint, greedy
    python -m models.generate --from-hf out/ --prompt-file p.txt --max-new-tokens 200 --temperature 0.8 --top-p 0.95
    python -m models.generate --load ckpt --prompt "import " --tp 2 --seed 1 --temperature 1 --top-k 40

Prints the prompt, then the continuation as it is generated (GPT.generate: a prefill, then one token per step
through a KV cache sharded over --tp ranks by heads). The text is tokenized with --tokenizer, else the tokenizer the
checkpoint's run trained with (or the --from-hf directory's own), else as UTF-8 bytes. Every check (the paths, the
sampling flags, a prompt longer than the model's context) is one line before any process starts; --tp T > 1 starts
T processes through torchrun's launcher, rank 0 printing.
"""
import argparse
import os
import sys
from typing import Any

from tp.mesh import launched_by_torchrun

from .generation import Text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", metavar="CKPT", help="a models.train checkpoint (DIR with latest, or a step-N)")
    source.add_argument("--from-hf", metavar="DIR", help="a Hugging Face directory (save_pretrained, --export-hf)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT")
    prompt.add_argument("--prompt-file", metavar="F", help="the prompt: this file's text")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to add (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (the default): greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample among the likeliest tokens whose probability reaches P")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="the sampling generator's seed")
    p.add_argument("--tokenizer", metavar="DIR", default=None, help="a Hugging Face tokenizer directory")
    p.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel processes (default: 1)")
    return p


def resolve(args: argparse.Namespace) -> tuple[Any, str | None, str | None]:
    """(the GPTConfig, the checkpoint directory or None, the tokenizer directory or None); one-line ValueErrors."""
    from .training import checkpoint, checkpoint_dirs
    from .training.data.tokenizer import has_tokenizer

    tokenizer = args.tokenizer
    if args.load:
        path = checkpoint_dirs.resume_path(args.load)
        try:
            meta = checkpoint.read_meta(path)
        except ValueError as e:
            raise ValueError(f"--load {args.load}: {e}") from None
        from .config import RUNTIME_FIELDS, GPTConfig

        config = GPTConfig(**{k: v for k, v in meta["config"].items() if k not in RUNTIME_FIELDS})
        saved = (meta.get("extra") or {}).get("tokenizer")
        tokenizer = tokenizer or (saved if saved and os.path.isdir(saved) else None)
        return config, path, tokenizer
    import transformers

    from .hf import check_safetensors, config_from_hf

    try:
        check_safetensors(args.from_hf)
    except ValueError as e:
        raise ValueError(f"--from-hf {args.from_hf}: {e}") from None
    config = config_from_hf(transformers.AutoConfig.from_pretrained(args.from_hf))
    return config, None, tokenizer or (args.from_hf if has_tokenizer(args.from_hf) else None)


def check(args: argparse.Namespace) -> tuple[Any, str | None, Text, list[int]]:
    """Every check before any process: (config, checkpoint path, Text, the prompt's ids)."""
    from .training.data.tokenizer import load_tokenizer

    given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
             if value is not None]
    if args.temperature == 0 and given:
        raise ValueError(f"{' and '.join(given)} {'is a sampling flag' if len(given) == 1 else 'sample'}: "
                         "give --temperature > 0 too (0, the default, is greedy)")
    for flag, value, ok, wanted in (("--temperature", args.temperature, args.temperature >= 0, ">= 0"),
                                    ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, ">= 1"),
                                    ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]")):
        if not ok:
            raise ValueError(f"{flag}={value} must be {wanted}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    config, path, tokenizer_dir = resolve(args)
    config.check_tp(args.tp)
    text = Text(load_tokenizer(tokenizer_dir) if tokenizer_dir else None)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise ValueError(f"--prompt-file {args.prompt_file}: no such file")
        with open(args.prompt_file, encoding="utf-8") as f:
            args.prompt = f.read()
    ids = text.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt is empty: give it at least one token")
    if max(ids) >= config.vocab_size:
        raise ValueError(f"the prompt has token {max(ids)}, outside the model's vocabulary of {config.vocab_size}"
                         + ("" if text.tokenizer else " (bytes: pass the tokenizer the model was trained with, "
                                                      "--tokenizer DIR)"))
    if len(ids) + args.max_new_tokens > config.max_seq_len:
        raise ValueError(f"the prompt ({len(ids)} tokens) and --max-new-tokens={args.max_new_tokens} exceed the "
                         f"model's context, max_seq_len={config.max_seq_len}"
                         + (": the prompt alone is longer" if len(ids) > config.max_seq_len else ""))
    return config, path, text, ids


def run(args: argparse.Namespace) -> int:
    """On each of --tp ranks (or this one process): build the model, generate, rank 0 printing as it goes."""
    import torch

    import tp

    from .generation import generate
    from .gpt import GPT

    config, path, text, ids = check(args)
    torch.set_num_threads(max(1, torch.get_num_threads() // args.tp))
    mesh = tp.init_mesh(tp=args.tp)
    if path:
        from .training import checkpoint

        torch.manual_seed(0)
        model = GPT(config, group=mesh.tp_group)
        checkpoint.load(path, model, None, mesh=mesh)
    else:
        model = GPT.from_hf(args.from_hf, group=mesh.tp_group)
    show = mesh.rank == 0
    if show and text.tokenizer is None and config.vocab_size > 256:
        print(f"note: no tokenizer for a vocabulary of {config.vocab_size}: the prompt is read as UTF-8 bytes and "
              "tokens past 255 print as <|id|> (--tokenizer DIR gives text)", file=sys.stderr)
    if show:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()

    def on_token(chosen):
        if show:
            sys.stdout.write(text.more(int(chosen[0])))
            sys.stdout.flush()

    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    generate(model, torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
             top_p=args.top_p, eos_token_id=text.eos, generator=generator, on_token=on_token)  # (GPT.generate's)
    if show:
        sys.stdout.write("\n")
        sys.stdout.flush()
    tp.destroy_mesh(keep_groups=launched_by_torchrun())
    return 0


def launch(argv: list[str], nproc: int) -> int:
    """--tp > 1 outside torchrun: the same command on nproc processes (torchrun's launcher, this machine)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from .training.launch import quiet_torchelastic

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    quiet_torchelastic()
    try:
        torchrun(get_args_parser().parse_args([f"--nproc-per-node={nproc}", "--standalone", "-m", "models.generate",
                                               *argv]))
    except ChildFailedError as e:
        rank, failure = min(e.failures.items(), key=lambda rf: rf[1].timestamp)
        print(f"error: generation failed on rank {rank} (exit code {failure.exitcode})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.tp < 1:
        print(f"error: --tp={args.tp} must be >= 1", file=sys.stderr)
        return 2
    try:
        if not launched_by_torchrun():
            check(args)  # one line here, before any process
            if args.tp > 1:
                return launch(argv, args.tp)
        return run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def entry() -> None:
    """`python -m models.generate`: main(), then the process's exit (models.training.launch.exit_process)."""
    from .training.launch import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
