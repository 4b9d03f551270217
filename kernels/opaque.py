"""Kernel launchers that run as torch.library custom ops under torch.compile and as plain calls in eager.

Dynamo cannot trace a Triton launch's host side (data pointers, the autotuner's hooks) nor a host loop over data it
only knows at run time (a grouped GEMM's group sizes), so a compiled graph calls each launcher whole, as one op, as
it would a cuBLAS GEMM; eager calls the function itself (no op dispatch overhead).
"""
import functools
from collections.abc import Callable, Iterable

import torch


class OpaqueLauncher:
    """A launcher: under torch.compile the custom op tp_kernels::<name>, in eager the function itself."""

    def __init__(self, fn: Callable, name: str, mutates_args: Iterable[str]) -> None:
        self.fn = fn
        self.op = torch.library.custom_op(f"tp_kernels::{name}", fn, mutates_args=tuple(mutates_args))
        functools.update_wrapper(self, fn)

    def register_fake(self, fake: Callable) -> Callable:
        """The op's output shapes and dtypes from its inputs' (what the compiler traces with)."""
        self.op.register_fake(fake)
        return fake

    def __call__(self, *args):
        return (self.op if torch.compiler.is_compiling() else self.fn)(*args)


def opaque_under_compile(name: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable], OpaqueLauncher]:
    """Decorator making a launcher (type-annotated, as torch.library requires) an OpaqueLauncher named `name`."""
    return lambda fn: OpaqueLauncher(fn, name, mutates_args)
