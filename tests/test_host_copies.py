"""Host copies for the GPU path (``dlab.comm.host``) and checkpoints that hold host tensors
wherever they were written. The CUDA cases run only where a GPU is (``python -m dlab check``
is the command that exercises the whole GPU path there)."""
from __future__ import annotations

import pytest
import torch

from dlab.comm.host import host_copies_done, pinned, to_host
from dlab.runtime import checkpoint

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_host_copy_never_aliases_its_source_and_casts():
    src = torch.arange(6, dtype=torch.bfloat16)
    out = to_host(src, torch.float32)
    src.add_(1)
    assert out.dtype == torch.float32 and out.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    same = to_host(src)
    assert same.dtype == torch.bfloat16 and same.data_ptr() != src.data_ptr()
    host_copies_done(torch.device("cpu"))  # a no-op on the CPU


def test_pinned_only_when_the_partner_is_a_gpu():
    t = torch.ones(3)
    assert pinned(t, torch.device("cpu")) is t


def test_a_checkpoint_piece_holds_a_host_copy():
    t = torch.ones(2, 3)
    p = checkpoint.piece(t)
    t.zero_()
    assert p["data"].device.type == "cpu" and p["data"].tolist() == [1.0] * 6 and p["shape"] == [2, 3]


@cuda
def test_gpu_to_host_copies_are_pinned_and_land_by_the_wait():
    src = torch.randn(1 << 20, device="cuda")
    out = to_host(src)
    host_copies_done(src.device)
    assert out.is_pinned() and torch.equal(out, src.cpu())
    assert pinned(torch.ones(4), src.device).is_pinned()


@cuda
def test_a_piece_written_from_the_gpu_loads_on_the_cpu_and_back():
    src = torch.randn(5, 7, device="cuda")
    p = checkpoint.piece(src)
    assert p["data"].device.type == "cpu"
    back = torch.empty_like(src)
    back.copy_(p["data"].view(5, 7))
    assert torch.equal(back, src)
