"""Local matmul kernels for the tensor-parallel layers (Triton on GPU, torch fallback on CPU)."""
from .ops import ACTIVATIONS, get_backend, linear_dgrad, linear_forward, linear_wgrad, use_backend  # noqa: F401
