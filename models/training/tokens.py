"""`python -m models.tokens`: a source tokenized once into Megatron's indexed dataset, PREFIX.bin + PREFIX.idx (one
sequence per document, each ended by the tokenizer's EOS; readable by Megatron-Core's IndexedDataset), at --out
PREFIX or in the token cache that `python -m models.train --data PATH` reads (models/training/data/build.py).
"""
import argparse
import sys

from . import data
from .config import DataConfig, JobConfig
from .data import indexed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.tokens", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True,
                   help="a .txt/.jsonl/.json/.parquet file, a directory of them, or a save_to_disk directory")
    p.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer directory (default: bytes)")
    p.add_argument("--out", default=None, metavar="PREFIX",
                   help="write PREFIX.bin + PREFIX.idx (default: the token cache, as models.train reads it)")
    p.add_argument("--data-column", default=None, metavar="NAME",
                   help="the JSON field or column to read (default: text; messages with --sft)")
    p.add_argument("--sft", action="store_true",
                   help="chat rows: also write the assistant tokens' loss mask, PREFIX_loss_mask.bin/.idx")
    p.add_argument("--data-cache-dir", default=None, metavar="DIR", help="the token cache (models.train's flag)")
    args = p.parse_args(argv)
    plan = data.DataPlan.of(JobConfig(data=DataConfig(path=[args.data], tokenizer=args.tokenizer,
                                                      column=args.data_column, sft=args.sft,
                                                      cache_dir=args.data_cache_dir)))
    (source,), reading = plan.sources, plan.reading
    try:
        out = args.out[:-4] if args.out and args.out.endswith((".bin", ".idx")) else args.out
        if not source.format.tokenized(reading):
            raise ValueError(f"--data {args.data} is a token file already")
        plan.check()
        if out is None:
            out = source.format.token_file(reading)
            index = indexed.read_index(out)
        else:
            index = data.build(args.data, reading.tokenizer_dir, out, column=reading.column, sft=args.sft)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}.bin: {index.num_tokens:,} {index.dtype.name} tokens, {index.documents:,} documents"
          + (f" (and its loss mask {out}{data.MASK_SUFFIX})" if args.sft else ""))
    return 0
