"""Local matmul kernels for the tensor-parallel layers: fused Triton kernels on GPU (or under TRITON_INTERPRET=1),
eager torch on CPU. The layers call the four primitives; models may call `linear` / `swiglu_linear` directly."""
from .linear import linear, swiglu_linear  # noqa: F401
from .ops import ACTIVATIONS, get_backend, linear_dgrad, linear_forward, linear_wgrad, use_backend  # noqa: F401

__all__ = ["linear", "swiglu_linear", "ACTIVATIONS", "use_backend", "get_backend", "linear_forward", "linear_dgrad",
           "linear_wgrad"]
