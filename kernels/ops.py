"""Dispatch of the local-matmul primitives: on CUDA the fastest of Triton, torch, and torch's GEMM with Triton's
elementwise passes for each call's shape, measured once (kernels.choice); Triton under TRITON_INTERPRET=1; torch
otherwise.

The tensor-parallel layers call only these four functions, so a backend can be swapped without touching them.
`use_backend("torch" | "triton" | "triton_epilogue" | "auto")` overrides the choice (also via the env var
TP_KERNELS_BACKEND); BACKENDS names the backends.
"""
import functools
import os

import torch

from . import choice, torch_ops
from . import fp8 as fp8_ops
from .dtypes import TRITON_DTYPES
from .fp8 import Fp8Scaling
from .torch_ops import ACTIVATIONS, check_activation  # noqa: F401

_backend = os.environ.get("TP_KERNELS_BACKEND", "auto")


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def get_backend() -> str:
    """The forced backend: "auto" (the default), "torch" or "triton"."""
    return _backend


class use_backend:
    """Force the backend ("auto", "torch" or "triton"): `kernels.use_backend("torch")` sets it from now on;
    `with kernels.use_backend("triton"): ...` sets it for the block and restores the previous one after."""

    def __init__(self, name: str) -> None:
        global _backend
        if name != "auto" and name not in BACKENDS:
            raise ValueError(f"unknown kernels backend {name!r}; expected one of {('auto', *BACKENDS)}")
        self.previous, _backend = _backend, name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _backend
        _backend = self.previous


def autocast_operands(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Under torch.autocast, (x, weight, bias) cast to the autocast dtype, as F.linear would compute; else as given.

    The Functions call this inside forward: the weight's gradient is then computed in the autocast dtype and
    autograd casts it back to the parameter's dtype (main_grad, if any, still accumulates in fp32).
    """
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    # autocast's eligibility rule: floating tensors other than fp64 (F.linear leaves fp64 alone)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (x, weight, bias))


def check_main_grad(main_grad: torch.Tensor, weight_shape: tuple[int, ...], device: torch.device) -> None:
    """main_grad must be an fp32 (or fp64) buffer shaped like the weight, on its device."""
    if tuple(main_grad.shape) != tuple(weight_shape) or main_grad.device != device or \
            main_grad.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"main_grad must be an fp32/fp64 tensor of shape {tuple(weight_shape)} on {device}, "
                         f"got {tuple(main_grad.shape)} {main_grad.dtype} on {main_grad.device}")


_triton_ops = None
_triton_import_error = None


def _load_triton_ops():
    """The Triton backend, imported on first use (so `import kernels` stays cheap and triton optional), or None:
    kernels.triton_hopper, which runs its persistent TMA kernels on Hopper GPUs and kernels.triton_ops' elsewhere."""
    global _triton_ops, _triton_import_error
    if _triton_ops is None and _triton_import_error is None:
        try:
            from . import triton_hopper
        except ImportError as e:  # triton missing or broken: auto falls back, forced "triton" reports this
            _triton_import_error = e
        else:
            _triton_ops = triton_hopper
    return _triton_ops


def _load_triton_epilogue():
    """torch's GEMMs with Triton's elementwise passes (kernels.triton_epilogue), or None without triton."""
    if _load_triton_ops() is None:
        return None
    from . import triton_epilogue

    return triton_epilogue


# name -> the module implementing the primitives, loaded on first use (triton is optional, and slow to import; None
# when it cannot be): the backends use_backend forces ("auto" measures them all per call shape on CUDA)
BACKENDS = {"torch": lambda: torch_ops, "triton": _load_triton_ops, "triton_epilogue": _load_triton_epilogue}


def _impl(x):
    """The module implementing the primitives for tensor x."""
    if _backend == "auto":
        # Under torch.compile, torch's ops: the compiler fuses the epilogues around cuBLAS and writes its own norm
        # and loss kernels, which the eager measurement cannot see (the Triton backend stays one forced op away).
        if torch.compiler.is_compiling() or not (x.is_cuda or _interpreting()):
            return torch_ops
        # Dtypes the kernels do not cover, and CPU tensors when TRITON_INTERPRET was set only after
        # kernels.triton_ops had been imported (its kernels were then built for a GPU), stay on torch.
        module = _load_triton_ops()
        usable = module is not None and x.dtype in TRITON_DTYPES
        return module if usable and (x.is_cuda or module.INTERPRET) else torch_ops
    module = BACKENDS[_backend]()
    if module is None:
        raise RuntimeError(f"kernels backend {_backend!r} was forced but triton cannot be imported: "
                           f"{_triton_import_error!r}")
    return module


def _measured(x: torch.Tensor, op: str, weight_shape: tuple[int, int], **flags):
    """The module for one primitive call: under "auto" on a measurable (CUDA) device, the fastest of the usable
    backends for this call's key (kernels.choice); everywhere else _impl(x). Under torch.compile's tracing nothing is
    measured (the tensors are fakes): _impl's choice, torch's."""
    default = _impl(x)
    if _backend != "auto" or default is torch_ops or not choice.measurable(x) or torch.compiler.is_compiling() \
            or 0 in (x.shape[0], *weight_shape):
        return default
    candidates = {name: module for name, load in BACKENDS.items() if (module := load()) is not None}
    family = getattr(candidates.get("triton"), "kernel_family", None)
    key = choice.make_key(op, x, *weight_shape, **flags, kernels=family(x) if family else "")
    return candidates[choice.choose(key, candidates, x.device)]


def fused_kernels(device: torch.device) -> bool:
    """Whether the fused Triton kernels (RMSNorm with the residual add, RoPE, the vocab-parallel loss) run for
    tensors on `device`: backend "auto" on CUDA only (CPU keeps the torch code, and its numbers), "triton" anywhere
    (CPU tensors need TRITON_INTERPRET=1), "torch" never."""
    if _backend == "torch" or (_backend == "auto" and (device.type != "cuda" or torch.compiler.is_compiling())):
        return False
    if _backend == "triton" and _load_triton_ops() is None:
        raise RuntimeError(f"kernels backend 'triton' was forced but triton cannot be imported: "
                           f"{_triton_import_error!r}")
    return _load_triton_ops() is not None


def bias_grad(dz: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sum of dz [M, N] accumulated in fp32 (fp64 for fp64), in `dtype`.

    Kept out of the kernels: it is memory-bound, and fusing it would need atomics (non-deterministic, and bf16
    atomics raise under the interpreter).
    """
    acc_dtype = torch.float64 if dz.dtype == torch.float64 else torch.float32
    return dz.sum(0, dtype=acc_dtype).to(dtype)


def backend_for(x: torch.Tensor) -> str:
    """"torch" or "triton": the backend the primitives would use for tensor x now."""
    return "torch" if _impl(x) is torch_ops else "triton"


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   activation: str | None = None, *,
                   fp8: Fp8Scaling | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = act(x @ weight.T + bias) for 2-D x [M, K] -> (y, the pre-activation saved for backward, or None).
    `fp8`: the GEMM in float8 (kernels.fp8) whatever the backend, its operands cast by one Triton pass each where
    fused_kernels says (kernels.fp8_cast); each of the three primitives takes it."""
    if fp8 is not None:
        return fp8_ops.linear_forward(x, weight, bias, activation, fp8=fp8, fused_cast=fused_kernels(x.device))
    module = _measured(x, "forward", weight.shape, activation=activation, bias=bias is not None)
    return module.linear_forward(x, weight, bias, activation)


def linear_dgrad(grad_out: torch.Tensor, weight: torch.Tensor, preact: torch.Tensor | None = None,
                 activation: str | None = None, *, need_input_grad: bool = True,
                 fp8: Fp8Scaling | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(grad_input [M, K] = dz @ weight, or None; dz [M, N] = grad_out · act'(preact))."""
    if fp8 is not None:
        return fp8_ops.linear_dgrad(grad_out, weight, preact, activation, fp8=fp8, need_input_grad=need_input_grad,
                                    fused_cast=fused_kernels(grad_out.device))
    # Without the input gradient only the activation's derivative runs: it follows the dgrad's choice (measured by
    # tune_linear), rather than a key of its own first met inside a step.
    module = _measured(grad_out, "dgrad", weight.shape, activation=activation)
    return module.linear_dgrad(grad_out, weight, preact, activation, need_input_grad=need_input_grad)


def linear_wgrad(dz: torch.Tensor | fp8_ops.Fp8Operand, x: torch.Tensor | fp8_ops.Fp8Operand, *,
                 main_grad: torch.Tensor | None = None, fp8: Fp8Scaling | None = None) -> torch.Tensor | None:
    """dW [N, K] = dzᵀ @ x; with a main_grad (fp32 [N, K]), accumulated into it in place and None returned. Under a
    tensorwise fp8, x (and dz) may be the casts the forward (and the dgrad) kept (kernels.fp8.Fp8Operand)."""
    if fp8 is None:
        # dz [tokens, N] and x [tokens, K] make the weight's gradient [N, K]
        wgrad = _measured(dz, "wgrad", (dz.shape[1], x.shape[1]), main_grad=main_grad is not None).linear_wgrad
    else:  # (x an Fp8Operand: the input a tensorwise forward kept, cast)
        kept = fp8_ops.linear_wgrad_kept if isinstance(x, fp8_ops.Fp8Operand) else fp8_ops.linear_wgrad
        wgrad = functools.partial(kept, fp8=fp8, fused_cast=fused_kernels(dz.device))
    if main_grad is None:
        return wgrad(dz, x)
    check_main_grad(main_grad, (dz.shape[1], x.shape[1]), dz.device)
    out = wgrad(dz, x, main_grad=main_grad)
    # The one place main_grad is accumulated: its owner may want to know (tp.optim counts a bucket's arrivals).
    hook = getattr(main_grad, "post_accumulate_hook", None)
    if hook is not None:
        hook()
    return out


def tune_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None, *,
                tokens: int, main_grad: bool = False) -> bool:
    """Launch the forward, dgrad and wgrad kernels of a linear with this (local) weight once on `tokens` zero rows,
    so that the autotuner picks their configs now, once per token bucket, and "auto" on CUDA measures which backend
    runs each primitive fastest (kernels.choice). A first launch inside a pipeline schedule would benchmark 5-7
    configs there, synchronising the device while a peer rank waits on this one in a receive.
    Only where the Triton kernels can run (not on the torch backend); returns whether it launched."""
    if _impl(weight) is torch_ops or tokens < 1:
        return False
    with torch.no_grad():
        x = weight.new_zeros(tokens, weight.shape[1])
        y, preact = linear_forward(x, weight, bias, activation)
        _, dz = linear_dgrad(torch.zeros_like(y), weight, preact, activation)
        grad_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        linear_wgrad(dz, x, main_grad=weight.new_zeros(weight.shape, dtype=grad_dtype) if main_grad else None)
    return True
