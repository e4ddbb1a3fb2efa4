"""hsx.target.attention on CPU: the per-token row starts its kernel masks with, and which tensors the kernel takes (the
kernel itself is checked against flash-attention on a GPU: tests/test_gpu.py)."""

import torch

from hsx.target import attention


def test_row_starts_name_each_tokens_row():
    cu = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)  # an empty row, a one-token row
    assert attention.row_starts(cu, 9).tolist() == [0, 0, 0, 3, 4, 4, 4, 4, 4]
    assert attention.row_starts(cu, 11).tolist()[-2:] == [9, 9]  # past the last row: a row of its own
    assert attention.row_starts(torch.tensor([0, 1], dtype=torch.int32), 1).tolist() == [0]


def test_kernel_takes_only_cuda_heads_it_was_written_for():
    q = torch.zeros(5, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(5, 4, 128, dtype=torch.bfloat16)
    assert not attention.supports(q, kv, kv)  # CPU tensors: the SDPA-per-row path stays
