"""Perplexity of a causal LM over token windows: the protocol's one number."""
from __future__ import annotations

import math

import torch

from ..progress import step


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True) -> dict:
    """Perplexity of a causal LM over ``windows`` [n, seqlen] → {"ppl", "nll", "windows", "tokens"}.
    Every token but each window's first is predicted (a leading BOS is context); NLL summed in fp64."""
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [n, seqlen >= 2], got {tuple(windows.shape)}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        with step(f"perplexity: {len(windows)} windows × {windows.shape[1]} tokens", progress,
                  total=len(windows), unit="window") as advance:
            for start in range(0, len(windows), batch_size):
                batch = windows[start : start + batch_size].to(device)
                logits = model(input_ids=batch).logits  # [b, seqlen, vocab]
                # One window at a time: fp32 logits of a 262k vocab are ~0.5 GB per window.
                for row, ids in zip(logits, batch):
                    nll = torch.nn.functional.cross_entropy(
                        row[:-1].float(), ids[1:], reduction="sum"
                    )
                    total += float(nll.double())
                    count += ids.numel() - 1
                advance(len(batch))
    finally:
        model.train(was_training)
    mean = total / count
    return {"ppl": math.exp(mean), "nll": mean, "windows": len(windows), "tokens": count}
