"""Layer Hessians ``H = XᵀX / n`` accumulated from calibration activations (fp64)."""
from __future__ import annotations

import torch


class Hessian:
    """Running ``XᵀX / n`` over the rows of every input fed to :meth:`add` (``[..., in]``).
    fp64 accumulation: a Hessian summed over 10⁵ tokens in fp32 loses the small
    eigenvalues that decide GPTQ's error propagation."""

    def __init__(self, columns: int, device="cpu"):
        self.sum = torch.zeros(columns, columns, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.sum.device, torch.float64)
        self.sum.addmm_(x.T, x)
        self.n += x.shape[0]

    @property
    def H(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError("no calibration rows were seen for this layer")
        return self.sum / self.n


def hook_linears(modules: dict[str, torch.nn.Linear]) -> tuple[dict[str, Hessian], list]:
    """Attach forward pre-hooks that accumulate each linear's input Hessian.
    Returns ``(hessians, handles)``; call ``h.remove()`` on every handle when done."""
    hessians, handles = {}, []
    for name, mod in modules.items():
        hs = hessians[name] = Hessian(mod.in_features, mod.weight.device)
        handles.append(mod.register_forward_pre_hook(lambda m, args, hs=hs: hs.add(args[0].detach())))
    return hessians, handles
