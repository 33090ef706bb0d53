"""bench/distributed.py's checkpoint comparison (its runs need torchrun and a reference model)."""
import torch
from safetensors.torch import save_file

from bench import distributed


def test_compare_counts_agreeing_values_and_outlier_lists_of_other_lengths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    q = torch.arange(8, dtype=torch.int32)
    save_file({"q": q, "outl": torch.ones(6, dtype=torch.float16), "norm": torch.ones(4).bfloat16()}, a / "s.safetensors")
    assert distributed.compare(a, a) == "identical"
    q2 = q.clone()
    q2[0] = 7
    save_file({"q": q2, "outl": torch.ones(10, dtype=torch.float16), "norm": torch.zeros(4).bfloat16()},
              b / "s.safetensors")
    # q: 7 of 8 agree; the outlier lists (6 vs 10 entries) count 10, none agreeing; bf16 tensors skipped
    assert distributed.compare(a, b) == f"{100 * 7 / 18:.4f}% agree"
