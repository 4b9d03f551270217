"""Suite-wide settings; they must run before any package module is imported.

- Without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1 must precede every @triton.jit).
- The layer tests use the torch backend for the local matmuls (the interpreter is slow); the kernel tests and a
  few layer tests force the Triton backend explicitly with `kernels.use_backend("triton")`.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TP_KERNELS_BACKEND", "torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # Hugging Face models are built from configs here: never ask the hub
torch.set_num_threads(1)
