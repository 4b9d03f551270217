"""The package's main job. Until the GPT and its 3D-parallel trainer land, it trains a residual stack of
tensor-parallel MLP blocks (Column -> GELU -> Row, optional sequence parallelism) with data parallelism (DDP over
the mesh's dp group) on CPU processes, and checks the first step's loss against the same model run serially.

    python -m models.train                          # spawns 4 CPU ranks: tp=2 x dp=2
    torchrun --nproc-per-node 8 -m models.train --tp 4 --sequence-parallel
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tp


class Block(nn.Module):
    """x + Row(GELU(Column(norm(x)))): one all-reduce forward and one backward (SP: all-gather + reduce-scatter)."""

    def __init__(self, hidden, ffn, *, sequence_parallel, group=None):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        for p in self.norm.parameters():  # under SP each rank sees a sequence chunk: grads summed over tp
            p.sequence_parallel = sequence_parallel
        self.fc1 = tp.ColumnParallelLinear(hidden, ffn, activation="gelu", sequence_parallel=sequence_parallel,
                                           group=group)
        self.fc2 = tp.RowParallelLinear(ffn, hidden, sequence_parallel=sequence_parallel, group=group)

    def forward(self, x):  # [s(/tp), b, h]
        return x + self.fc2(self.fc1(self.norm(x)))


def build(args, group=None):
    torch.manual_seed(args.seed)  # same seed everywhere: shards are slices of the serial weights
    blocks = [Block(args.hidden, args.ffn, sequence_parallel=args.sequence_parallel, group=group)
              for _ in range(args.layers)]
    return nn.Sequential(*blocks)


def batch(args, step, mesh):
    """Synthetic regression data: target = sin(x); each dp replica draws its own micro-batch."""
    g = torch.Generator().manual_seed(1000 * step + mesh.dp_rank)
    x = torch.randn(args.seq, args.batch, args.hidden, generator=g)  # [s, b, h]
    return x, torch.sin(x)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn when not launched by torchrun")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:  # not under torchrun: become torchrun, on CPU processes
        from torch.distributed.run import main as torchrun

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        return torchrun([f"--nproc-per-node={args.nproc}", "--standalone",
                         "-m", "models.train", *(argv if argv is not None else sys.argv[1:])])
    train(args)


def train(args):
    torch.set_num_threads(1)
    mesh = tp.init_mesh(tp=args.tp, backend="gloo")
    log = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    log(f"{mesh.world_size} ranks: tp={mesh.tp_size} dp={mesh.dp_size} pp={mesh.pp_size}; "
        f"sequence_parallel={args.sequence_parallel}")
    model = build(args)
    log(model[0])

    # The parallel model must compute what the serial one does: compare the first loss with a dense replay.
    x, y = batch(args, 0, mesh)
    shard = (lambda t: t.chunk(mesh.tp_size, 0)[mesh.tp_rank]) if args.sequence_parallel else (lambda t: t)
    with torch.no_grad():
        parallel_loss = F.mse_loss(model(shard(x)), shard(y))
        if args.sequence_parallel:  # each tp rank holds the loss of its sequence chunk
            dist.all_reduce(parallel_loss, group=mesh.tp_group)
            parallel_loss /= mesh.tp_size
        serial_loss = F.mse_loss(_dense_copy(args)(x), y)
    log(f"step 0: parallel loss {parallel_loss.item():.8f}, serial {serial_loss.item():.8f}, "
        f"|diff| {(parallel_loss - serial_loss).abs().item():.2e}")

    ddp = DistributedDataParallel(model, process_group=mesh.dp_group) if mesh.dp_size > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(args, step, mesh)
        loss = F.mse_loss(ddp(shard(x)), shard(y))  # SP: the mean over this rank's sequence chunk
        opt.zero_grad(set_to_none=True)
        # The serial loss is the mean over all chunks: each tp rank backpropagates its 1/tp share (the TP
        # collectives sum the shares), else every gradient would be tp times too large.
        (loss / mesh.tp_size if args.sequence_parallel else loss).backward()
        tp.allreduce_sequence_parallel_grads(model)
        opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)  # mean over every rank's (tp-replicated or sequence-chunk) loss
        if step % 5 == 0 or step == args.steps - 1:
            log(f"step {step:3d}  loss {reported.item() / mesh.world_size:.5f}")
    log(f"{args.steps} steps in {time.perf_counter() - start:.2f}s")
    tp.destroy_mesh()


def _dense_copy(args):
    """The same model with TP=1 (a one-rank group per process), built from the same seed."""
    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return build(args, group=solo)


if __name__ == "__main__":
    main()
