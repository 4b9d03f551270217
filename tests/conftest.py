"""Suite-wide settings; they must run before any package module is imported.

- Triton kernels run under the interpreter (TRITON_INTERPRET=1 must precede every @triton.jit) unless the tests' tensors
  are on a GPU (TP_TEST_DEVICE=cuda or nccl, with CUDA: tp/testing.py): even with a GPU present, the default run's
  tensors are on the CPU, which only the interpreter takes; so are the training jobs' (TP_DEVICE=cpu: models.train's
  --device auto), whatever TP_TEST_DEVICE says.
- Tests marked `slow` (expensive variants of a fast check) are left out by pytest.ini; `-m slow` runs them.
- The test process computes on OMP_NUM_THREADS threads when it is set, else on 1 (tp.testing's ranks too, within
  their share of the cores): the suite passes at any thread count (a reduction split over threads rounds otherwise:
  no test depends on that rounding).
- `single_agent_run`: one job run once per session for the launch tests that compare other launchers with it.
- The layer tests use the torch backend for the local matmuls (the interpreter is slow); the kernel tests and a
  few layer tests force the Triton backend explicitly with `kernels.use_backend("triton")`.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TP_TEST_DEVICE", "cpu") in ("", "cpu"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the training jobs the tests start: gloo ranks on the CPU, also under TP_TEST_DEVICE=cuda (their 8 ranks on one GPU
# are refused by the job; bench.gpu_check's job section runs it on the GPU)
os.environ.setdefault("TP_DEVICE", "cpu")
os.environ.setdefault("TP_KERNELS_BACKEND", "torch")
os.environ.setdefault("TP_HOST_CHECKS", "1")  # bad ids raise their one-line ValueError on GPUs too (tp/debug.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # Hugging Face models are built from configs here: never ask the hub
threads = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)


@pytest.fixture(scope="session")
def single_agent_run(tmp_path_factory):
    """`python -m models.train` at tests.helpers.SINGLE_AGENT from one agent on this machine, in a user's environment
    (no torchrun or SLURM variables): (its CompletedProcess, its JSONL log's path)."""
    from .helpers import SINGLE_AGENT

    log = tmp_path_factory.mktemp("single_agent") / "single.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}
    root = str(Path(__file__).resolve().parent.parent)
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "models.train", *SINGLE_AGENT, "--log-jsonl", str(log)],
                            cwd=log.parent, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, log
