"""The dtypes the Triton kernels cover (the dispatcher keeps the others on torch)."""
import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
