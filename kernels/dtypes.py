"""The dtypes the Triton kernels cover (the dispatcher keeps the others on torch), and the float8 formats the fp8
linears cast to."""
import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
