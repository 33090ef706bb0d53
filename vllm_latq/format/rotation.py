"""The input rotation of a rotated checkpoint (``quantization_config.rotation``): a seeded
random-sign block Hadamard matrix R on every quantized linear's input dimension. The stored
integers quantize ``W·R``; readers rotate the activations (the kernels) or take ``W = Q·Rᵀ``.

R is block-diagonal with n/b copies of ``R_b = diag(s)·H_b/√b`` (``H_b`` Sylvester's, ``b =
block_size(n)``, ``s`` drawn as compressed-tensors draws its signs: docs/FORMAT.md). R depends only
on the seed and b, so linears that read one activation (q/k/v, gate/up, experts) transform it once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import FormatError

KINDS = ("hadamard",)
# The largest block: a row-parallel cut at tensor-parallel size t is exact where b divides n/t,
# which up to t = 8 holds for the row-parallel inputs of common models at 256 (an 8B Llama's
# 14336 = 2¹¹·7 columns cut 8 ways leave 2⁸·7), and a 256-wide block is one Triton tile row.
MAX_BLOCK = 256


def largest_pow2_divisor(n: int) -> int:
    return n & -n


@dataclass(frozen=True)
class Rotation:
    """``quantization_config.rotation``: ``{"kind": "hadamard", "seed": s, "max_block": m}``."""
    seed: int
    max_block: int = MAX_BLOCK
    kind: str = "hadamard"

    def block_size(self, n: int) -> int:
        """The block of an n-column input: the largest power of two dividing n, at most ``max_block``."""
        return min(self.max_block, largest_pow2_divisor(n))

    def signs(self, n: int) -> torch.Tensor:
        """fp32 ±1 ``[b]``: the signs of an n-column input's blocks (the same in every block)."""
        return hadamard_signs(self.seed, self.block_size(n))

    def config(self) -> dict:
        return {"kind": self.kind, "seed": self.seed, "max_block": self.max_block}


def hadamard_signs(seed: int, block: int) -> torch.Tensor:
    """fp32 ±1 ``[block]``: ``2·randint(0, 2) − 1`` drawn from a CPU generator seeded with
    ``seed`` (the draws compressed-tensors makes for one random Hadamard matrix)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (2 * torch.randint(0, 2, (block,), generator=gen) - 1).float()


def parse_rotation(r, file) -> Rotation | None:
    """``quantization_config.rotation`` (absent/null: none) → :class:`Rotation`, or FormatError."""
    if r is None:
        return None
    if not isinstance(r, dict) or set(r) != {"kind", "seed", "max_block"}:
        raise FormatError(f'quantization_config.rotation must be null or {{"kind", "seed", "max_block"}}, got {r!r}',
                          file=file)
    if r["kind"] not in KINDS:
        raise FormatError(f"quantization_config.rotation.kind is {r['kind']!r}, expected one of {KINDS}", file=file)
    seed, mb = r["seed"], r["max_block"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise FormatError(f"quantization_config.rotation.seed must be an integer in [0, 2^63), got {seed!r}", file=file)
    if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= MAX_BLOCK or mb & (mb - 1):
        raise FormatError(f"quantization_config.rotation.max_block must be a power of two in 1..{MAX_BLOCK}, got "
                          f"{mb!r}", file=file)
    return Rotation(seed, mb, r["kind"])


# ----------------------------------------------------------------------------- the transform

def fwht_(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x ← x·(I ⊗ H_block)`` in place on the last dimension of a contiguous x (unnormalised
    Sylvester Hadamard per block): log2(block) butterfly passes, O(n log b) instead of a matrix
    product's O(n·b), with one half-size temporary."""
    v = x.view(-1, block)
    h = 1
    while h < block:
        u = v.view(-1, block // (2 * h), 2, h)
        a = u[:, :, 0].clone()
        u[:, :, 0].add_(u[:, :, 1])
        u[:, :, 1].sub_(a).neg_()
        h *= 2
    return x


def _blocks(x: torch.Tensor, signs: torch.Tensor) -> int:
    b = signs.numel()
    if x.shape[-1] % b:
        raise ValueError(f"a rotation with {b}-column blocks on {x.shape[-1]} columns (not a multiple)")
    return b


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x·R`` on the last dimension (R block-diagonal, ``R_b = diag(signs)·H_b/√b``), computed in
    fp32 (fp64 for fp64 x), returned in x's dtype: the activations a rotated layer multiplies."""
    b = _blocks(x, signs)
    dt = _compute_dtype(x)
    y = x.to(dt).reshape(*x.shape[:-1], -1, b) * (signs.to(x.device, dt) / math.sqrt(b))
    return fwht_(y, b).reshape(x.shape).to(x.dtype)


def unrotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x·Rᵀ`` (R orthogonal: the inverse of :func:`rotate`); on a weight's rows, the stored
    ``Q`` of a rotated layer → the weight ``Q·Rᵀ`` it serves."""
    b = _blocks(x, signs)
    dt = _compute_dtype(x)
    y = fwht_(x.to(dt, copy=True).contiguous(), b).reshape(*x.shape[:-1], -1, b)
    return y.mul_(signs.to(x.device, dt) / math.sqrt(b)).reshape(x.shape).to(x.dtype)


def random_hadamard(signs: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``diag(s)·H_b`` ``[b, b]`` (±1): the transform weight compressed-tensors' readers divide by √b."""
    b = signs.numel()
    return fwht_(torch.diag(signs.to(torch.float64)).contiguous(), b).to(dtype)


def transform_scheme(block: int, targets: list[str]) -> dict:
    """compressed-tensors' ``TransformScheme`` JSON of R on ``targets`` (docs/FORMAT.md, "Export")."""
    return {"type": "random-hadamard", "head_dim": block, "randomize": False, "requires_grad": False,
            "precision": "float32", "apply": [{"targets": list(targets), "location": "input", "inverse": False,
                                               "ignore": []}]}


def matrix(signs: torch.Tensor, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """R itself, ``[n, n]`` (tests and small problems; the transform never builds it)."""
    return rotate(torch.eye(n, dtype=dtype), signs)
