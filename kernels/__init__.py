"""Local matmul kernels for the tensor-parallel layers: fused Triton kernels on GPU (or under TRITON_INTERPRET=1),
eager torch on CPU. The layers call the four primitives; models may call `linear` / `swiglu_linear` directly; the
experts of mixture-of-experts layers call `grouped_linear` (one weight per contiguous group of rows).
`fp8_recipe=` (linear) and `fp8=` (the primitives) run the GEMMs in float8: kernels.fp8, FP8_RECIPES."""
from .choice import choices  # noqa: F401
from .fp8 import FP8_RECIPES  # noqa: F401
from .grouped import grouped_dgrad, grouped_forward, grouped_linear, grouped_wgrad  # noqa: F401
from .linear import linear, swiglu_linear  # noqa: F401
from .ops import ACTIVATIONS, get_backend, linear_dgrad, linear_forward, linear_wgrad, tune_linear, use_backend  # noqa: F401

__all__ = ["linear", "swiglu_linear", "ACTIVATIONS", "use_backend", "get_backend", "linear_forward", "linear_dgrad",
           "linear_wgrad", "tune_linear", "grouped_linear", "grouped_forward", "grouped_dgrad", "grouped_wgrad",
           "FP8_RECIPES", "choices"]
