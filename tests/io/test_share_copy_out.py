"""The copy out of a replica broadcast's flat buffer into the replicated parameters' local tensors: one op where every
tensor is contiguous, one copy each where one is not. Expected values are cut from the buffer by hand."""

from __future__ import annotations

import torch

from workbench.io.hf.load import _copy_out


def _flat(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def test_contiguous_tensors_get_their_pieces_in_order() -> None:
    shapes = [(3,), (2, 4), (1,), (5, 2)]
    tensors = [torch.full(s, -1.0) for s in shapes]
    flat = _flat(3 + 8 + 1 + 10)
    _copy_out(flat, tensors)
    assert torch.equal(tensors[0], torch.tensor([0.0, 1, 2]))
    assert torch.equal(tensors[1], torch.arange(3.0, 11).reshape(2, 4))
    assert torch.equal(tensors[2], torch.tensor([11.0]))
    assert torch.equal(tensors[3], torch.arange(12.0, 22).reshape(5, 2))


def test_a_strided_tensor_gets_its_piece_in_its_own_shape() -> None:
    base = torch.full((4, 3), -1.0)
    strided = base.t()  # (3, 4), not contiguous: written through its strides
    head = torch.full((2,), -1.0)
    flat = _flat(2 + 12)
    _copy_out(flat, [head, strided])
    assert torch.equal(head, torch.tensor([0.0, 1]))
    assert torch.equal(strided, torch.arange(2.0, 14).reshape(3, 4))
    assert torch.equal(base, torch.arange(2.0, 14).reshape(3, 4).t())
