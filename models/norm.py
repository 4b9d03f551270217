"""The norms of the transformer's residual stream (RMSNorm, LayerNorm) and the weights' normal initialisation."""
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kernels.ops
import tp
from tp.mesh import SharedGroup, resolve_group


def normal_init(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class Norm(nn.Module):
    """RMSNorm (Hugging Face's: fp32 statistics, weight applied in the input dtype) or LayerNorm.

    Under sequence parallelism each rank normalises its own tokens, so the parameters' grads are partial: they are
    summed over the tp group inside backward (one all-reduce per norm), or, with `grad_sync=False`, tagged
    `sequence_parallel` for one coalesced `tp.allreduce_sequence_parallel_grads` after backward.
    """

    group = SharedGroup()  # deep copies (EMA, reference models) share the groups

    def __init__(self, kind: str, hidden: int, eps: float, *, sequence_parallel: bool = False, grad_sync: bool = True,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.kind, self.eps, self.sequence_parallel = kind, eps, sequence_parallel
        self.sync = sequence_parallel and grad_sync  # else (SP) tagged for tp.allreduce_sequence_parallel_grads
        self.group = resolve_group(group) if sequence_parallel else group
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device)) if kind == "layernorm" else None
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel and not grad_sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s(/tp), b, h]
        params = self._params()
        if self.kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], *params, self.eps)
        fused = self._fused(x)
        if fused:
            return fused.rms_norm(x, params[0], self.eps)[0]
        return params[0] * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)  # HF's: weight in x's dtype

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): one fused kernel each way where the fused kernels run (RMSNorm),
        else the add and forward."""
        fused = self.kind == "rmsnorm" and self._fused(x, residual)
        if fused:
            return fused.rms_norm(x, self._params()[0], self.eps, residual=residual)
        total = residual + x
        return self(total), total

    def _params(self):
        params = (self.weight,) if self.bias is None else (self.weight, self.bias)
        return tp.sync_grads_over_tp(*params, group=self.group) if self.sync else params

    def _fused(self, x, residual=None):
        """kernels/rms_norm.py where its fused kernel runs for these operands (kernels.ops.fused_kernels: CUDA under
        "auto", never on "torch"), else None."""
        if not kernels.ops.fused_kernels(x.device):
            return None
        from kernels import rms_norm  # (imports triton: only where the fused kernels run)

        return rms_norm if rms_norm.supports(x, self.weight, residual) else None

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.weight.shape[0]}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"
