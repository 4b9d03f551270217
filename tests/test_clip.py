"""tp.clip_grad_norm_ as a drop-in for torch.nn.utils.clip_grad_norm_ on a dense model in one process: the same norm
and the same clipped gradients (fp64 to ~1e-12), for an iterable of parameters and for a single tensor."""
import torch
from torch import nn

import tp
from tp.testing import distributed


def _dense_pair():
    """Two copies of one fp64 MLP with the same gradients."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(7, 9, dtype=torch.float64), nn.Tanh(), nn.Linear(9, 3, dtype=torch.float64))
    b = nn.Sequential(nn.Linear(7, 9, dtype=torch.float64), nn.Tanh(), nn.Linear(9, 3, dtype=torch.float64))
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 7, dtype=torch.float64)
    for model in (a, b):
        model(x).square().sum().backward()
    return a, b


@distributed(world_size=1)
def test_clipped_gradients_are_torchs_in_fp64():
    tp.init_mesh()
    a, b = _dense_pair()
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    norm = tp.clip_grad_norm_(b.parameters(), 0.1)
    assert abs(norm.item() - expected.item()) <= 1e-6 * expected.item()
    for p, q in zip(a.parameters(), b.parameters()):
        err = (p.grad - q.grad).abs().max().item() / p.grad.abs().max().item()
        assert err <= 1e-12, f"clipped gradients differ by {err:.2g} (relative): the coefficient lost precision"


@distributed(world_size=1)
def test_a_single_tensor_is_clipped_as_torch_clips_it():
    """torch.nn.utils.clip_grad_norm_ takes one tensor as well as an iterable (not the tensor's rows)."""
    tp.init_mesh()
    a, b = _dense_pair()
    expected = torch.nn.utils.clip_grad_norm_(a[0].weight, 0.01)
    norm = tp.clip_grad_norm_(b[0].weight, 0.01)
    assert abs(norm.item() - expected.item()) <= 1e-6 * expected.item(), (norm.item(), expected.item())
    assert torch.allclose(b[0].weight.grad, a[0].weight.grad, rtol=1e-12, atol=0)


@distributed(world_size=1)
def test_one_rank_never_moves_the_norm_to_the_collectives_device(monkeypatch):
    """The sum of squares stays on the gradients' device: one process needs no collective, so nothing goes to the
    collectives' device (on a GPU under gloo, the CPU: each move there and back was a host sync per parameter, 198
    per step of a 1B model on an H200). A device nothing can be copied out of stands in for it here."""
    import tp.clip

    monkeypatch.setattr(tp.clip, "collective_device", lambda: torch.device("meta"))
    tp.init_mesh()
    a, b = _dense_pair()
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    norm = tp.clip_grad_norm_(b.parameters(), 0.1)
    assert norm.device == expected.device and abs(norm.item() - expected.item()) <= 1e-6 * expected.item()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-12, atol=0)


@distributed(world_size=2)
def test_an_fsdp2_gradients_offset_is_torchs_without_reading_a_tensor():
    """FSDP2's Shard(0) splits dim 0 as torch.chunk does; clipping computes each rank's first row itself (torch's
    compute_local_shape_and_global_offset builds and reads a tensor on the default device: a GPU sync a parameter).
    Odd row counts over 2 ranks, an empty shard among them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from tp.clip import reduced_grad

    mesh = init_device_mesh("cpu", (2,))
    for rows in (1, 3, 7):
        layer = fully_shard(nn.Linear(4, rows, bias=False), mesh=mesh)
        layer(torch.randn(2, 4)).sum().backward()
        grad, offset, _ = reduced_grad(layer.weight)
        _, first = compute_local_shape_and_global_offset(layer.weight.grad.shape, mesh, layer.weight.grad.placements)
        assert (offset, grad.numel()) == (first[0] * 4, layer.weight.grad.to_local().numel()), rows
