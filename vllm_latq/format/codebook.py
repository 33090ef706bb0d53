"""The codebook kind (method ``e8``): E8 codebooks, codes ↔ points, a layer's tensors; one definition
for the solver and the readers (docs/FORMAT.md, "kind codebook")."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import scale_codes
from ..errors import FormatError

DIM = 8                  # a block: eight consecutive input columns, E8's dimension
E8P, BALL = "e8p", "ball256"
CODE_BYTES = {E8P: 2, BALL: 1}
# what latq-export says of a codebook layer, after its name
NOT_EXPORTED = ("the codebook form (method e8) has no export: no GGUF or compressed-tensors type holds E8 codes; "
                "serve it with latq's plugin (latq-serve)")


def _half_odd_patterns(max_norm2: float) -> list[tuple[float, ...]]:
    top = int(math.sqrt(max_norm2 - (DIM - 1) * 0.25) + 0.5)
    vals = [k + 0.5 for k in range(top)]
    return [p for p in itertools.product(vals, repeat=DIM) if sum(v * v for v in p) <= max_norm2 + 1e-9]


@lru_cache(maxsize=None)
def e8p_patterns() -> torch.Tensor:
    """E8P's 256 absolute patterns ``[256, 8]`` fp64 (docs/FORMAT.md, "kind codebook")."""
    inner = _half_odd_patterns(10.0)
    extra = sorted(set(itertools.permutations((1.5,) * 5 + (0.5,) * 3)), reverse=True)[:256 - len(inner)]
    return torch.tensor(inner + extra, dtype=torch.float64, device="cpu")   # a constant: moved where used


@lru_cache(maxsize=None)
def e8_ball256() -> torch.Tensor:
    """The origin, E8's 240 roots and the vectors ±2eᵢ but −2e₇: 256 points ``[256, 8]`` fp64."""
    roots = [v for v in itertools.product((-1.0, 0.0, 1.0), repeat=DIM) if sum(map(abs, v)) == 2]
    roots += [v for v in itertools.product((-0.5, 0.5), repeat=DIM) if sum(v) % 2 == 0]
    axes = [tuple(2.0 * s if j == i else 0.0 for j in range(DIM)) for s in (1, -1) for i in range(DIM)][:15]
    return torch.tensor([(0.0,) * DIM] + roots + axes, dtype=torch.float64, device="cpu")


def _keys(p: torch.Tensor) -> torch.Tensor:
    """Points of ½ℤ⁸ with coordinates in [−4, 4] → distinct int64 keys (base 17, one exact fp64 product)."""
    d = torch.round(p.to(torch.promote_types(p.dtype, torch.float32)) * 2 + 8).double()
    return (d @ (17.0 ** torch.arange(DIM, dtype=torch.float64, device=p.device))).long()


@lru_cache(maxsize=None)
def _table_keys(book: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted keys, table index of each) of E8P's patterns or the ball's points."""
    keys = _keys(e8p_patterns() if book == E8P else e8_ball256())
    order = torch.argsort(keys)
    return keys[order], order


def table_index(book: str, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Points ``p [..., 8]`` → (their rows in ``book``'s table (E8P: of |p|), whether they are in it)."""
    keys, index = _table_keys(book)
    keys, index = keys.to(p.device), index.to(p.device)
    inside = (p.abs() <= 4).all(-1)
    k = _keys(p.clamp(-4, 4))   # a point outside: its key matches no row (no table coordinate is ±4)
    at = torch.searchsorted(keys, k).clamp(max=len(keys) - 1)
    return index[at], inside & (keys[at] == k)


def _e8p_parts(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A point of E8 + ¼ → (its half-odd part σ⊙a, its shift bit: 0 for +¼, 1 for −¼)."""
    y = p.to(torch.promote_types(p.dtype, torch.float32)) - 0.25   # exact: points are multiples of ¼
    minus = ~(torch.remainder(y * 2, 2) == 1).all(-1)   # y not half-odd: the point is σ⊙a − ¼
    return torch.where(minus[..., None], y + 0.5, y), minus.long()


def in_e8p(p: torch.Tensor) -> torch.Tensor:
    """Whether each point ``p [..., 8]`` of E8 + ¼ is an E8P point (its pattern in the table)."""
    return table_index(E8P, _e8p_parts(p)[0].abs())[1]


def encode_e8p(p: torch.Tensor) -> torch.Tensor:
    """E8P points ``[..., 8]`` → their 16-bit codes (int64)."""
    y, shift = _e8p_parts(p)
    idx, ok = table_index(E8P, y.abs())
    if not ok.all():
        raise ValueError("a point outside E8P cannot be encoded")
    bits = 2.0 ** torch.arange(8, 15, dtype=torch.float64, device=p.device)
    signs = ((y[..., :DIM - 1] < 0).double() @ bits).long()
    return idx | signs | (shift << 15)


def decode_e8p(c: torch.Tensor) -> torch.Tensor:
    """16-bit codes ``[...]`` (any integer dtype) → fp32 E8P points ``[..., 8]``."""
    c = c.long()
    a = e8p_patterns().to(c.device, torch.float32)[c & 255]
    neg = (c[..., None] >> torch.arange(8, 15, device=c.device)) & 1
    sigma = torch.cat([1.0 - 2.0 * neg.float(), torch.ones_like(a[..., :1])], -1)
    odd = torch.remainder((sigma * a).sum(-1), 2) != 0
    sigma[..., -1] = torch.where(odd, -1.0, 1.0)
    return sigma * a + torch.where((c >> 15) & 1 == 1, -0.25, 0.25)[..., None]


@dataclass(frozen=True)
class Stage:
    """One stage of a code: a point of ``book``'s codebook for the residual times ``gain``."""
    book: str
    gain: float


@dataclass(frozen=True)
class Codebook:
    """A code of residual stages: a block's point is Σᵢ pᵢ / gainᵢ, its bytes each stage's code."""
    name: str
    stages: tuple[Stage, ...]

    @property
    def index_bytes(self) -> int:
        return sum(CODE_BYTES[s.book] for s in self.stages)

    @property
    def bits(self) -> int:
        return self.index_bytes * 8 // DIM

    @property
    def max_abs(self) -> float:
        """A bound on a point's coordinates: each stage's largest over its gain, summed."""
        top = {E8P: float(e8p_patterns().max()) + 0.25, BALL: float(e8_ball256().abs().max())}
        return sum(top[s.book] / s.gain for s in self.stages)


# by bits a weight; the residual gains minimise the mean squared error of unit Gaussian blocks
CODEBOOKS = {2: Codebook("e8p", (Stage(E8P, 1.0),)),
             3: Codebook("e8p+ball256", (Stage(E8P, 1.0), Stage(BALL, 2.0))),
             4: Codebook("e8p+e8p", (Stage(E8P, 1.0), Stage(E8P, 4.0)))}


def encode(points: list[torch.Tensor], book: Codebook) -> torch.Tensor:
    """Each stage's points ``[..., 8]`` (in its own units) → uint8 codes ``[..., index_bytes]``."""
    out = []
    for stage, p in zip(book.stages, points, strict=True):
        if stage.book == E8P:
            c = encode_e8p(p)
            out += [c & 255, c >> 8]
        else:
            idx, ok = table_index(BALL, p)
            if not ok.all():
                raise ValueError("a point outside the 256-point ball cannot be encoded")
            out.append(idx)
    return torch.stack(out, -1).to(torch.uint8)


def decode(codes: torch.Tensor, book: Codebook) -> torch.Tensor:
    """uint8 codes ``[..., index_bytes]`` → fp32 points ``[..., 8]`` (exact: multiples of 1/16)."""
    c = codes.long()
    v, at = None, 0
    for stage in book.stages:
        if stage.book == E8P:
            p = decode_e8p(c[..., at] | (c[..., at + 1] << 8))
        else:
            p = e8_ball256().to(c.device, torch.float32)[c[..., at]]
        at += CODE_BYTES[stage.book]
        v = p / stage.gain if v is None else v + p / stage.gain
    return v


# ----------------------------------------------------------------------------- a layer's tensors

def groups_of_blocks(in_features: int, group_size: int | None, device=None) -> torch.Tensor:
    """int64 ``[in/8]``: the scale group of each block (``group_size`` None: one a row)."""
    g = group_size or in_features
    return torch.arange(0, in_features, DIM, device=device) // g


def shapes(shape: tuple[int, int], bits: int, group_size: int, coded: bool) -> dict:
    """A layer's tensors ``{suffix: (shape, dtype)}``: ``codes`` and its group scales, fp16 or coded."""
    out, cin = shape
    ng = math.ceil(cin / group_size)
    scales = scale_codes.shapes(out, ng) if coded else {"scales": ((out, ng), torch.float16)}
    return {"codes": ((out, cin // DIM, CODEBOOKS[bits].index_bytes), torch.uint8), **scales}


def check_layer_shape(shape: tuple[int, int], *, layer: str, file: str | None = None) -> None:
    """A codebook layer's input columns are whole blocks."""
    if shape[1] % DIM:
        raise FormatError(f"{shape[1]} input columns: a codebook layer needs a multiple of {DIM}", file=file,
                          tensor=layer)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """fp32 ``[out, in]``: each block's point times its group's scale; the one definition of the
    codebook kind's math (exact: a point has at most 7 significant bits, a scale 11)."""
    out, nblocks, _ = codes.shape
    v = decode(codes, CODEBOOKS[bits])
    s = scales.float()[:, groups_of_blocks(nblocks * DIM, group_size, codes.device)]
    return (v * s[..., None]).reshape(out, nblocks * DIM)
