"""A checkpoint served through each of latq's kernel families on this machine, without vLLM: the
serving check the plugin runs (``verify_for_serving``), then each distinct layer's runtime form
built as the plugin's loader builds it and selected with ``LATQ_KERNEL=<family>``. Each family
serves the layer (its output against the checkpoint's dequantized weights) or refuses it in one
line naming the family and why; anything else raises."""
from __future__ import annotations

import contextlib
import os

import torch

from .. import format as fmt
from ..format.checkpoint import Checkpoint
from ..kernels import selector
from ..kernels.rotated import with_rotation
from ..kernels.transcode import transcode
from ..plugin.slicing import slice_codebook, slice_dense

# served output vs x·Wᵀ in fp32, relative in norm: bf16 activations (rotated ones rounded again)
TOLERANCE = 2e-2
# rows served of a layer: the tiny models' heads (a 49152-word vocabulary) as one TP rank's shard of
# them, a multiple of the scale codes' 16-row grids (Triton's interpreter takes seconds a 1000 rows)
MAX_ROWS = 256


@contextlib.contextmanager
def forced(family: str):
    """``LATQ_KERNEL=family`` within the block."""
    before = os.environ.get(selector.ENV_FORCE)
    os.environ[selector.ENV_FORCE] = family
    try:
        yield
    finally:
        if before is None:
            del os.environ[selector.ENV_FORCE]
        else:
            os.environ[selector.ENV_FORCE] = before


def runtime_weight(t: dict, spec: fmt.QuantSpec, module: str, shape: tuple[int, int], rows: int, family):
    """Layer ``module``'s first ``rows`` rows in the runtime form, cut as the loader cuts a rank's."""
    bits, cin = spec.bits_of(module), shape[1]
    coded = fmt.has_coded_scales(t)
    if spec.kind == "dense":
        w = slice_dense(t, bits, spec.group_size, cin, [(0, rows)], 0, cin, coded=coded)
    elif spec.kind == "codebook":
        w = slice_codebook(t, bits, spec.group_size, [(0, rows)], 0, cin, coded=coded)
    else:
        z = fmt.decode_integers(t, "huffman", shape, None)[:rows]
        w = transcode(z, t["hscale"].float().expand(rows), family=family)
    return with_rotation(w, spec.rotation, cin, 0, module)


def distinct_layers(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """One layer per (shape, bits): {module: its dequantized weight, the one it serves}."""
    seen, out = set(), {}
    for name, W in ck.dequantized_tensors(torch.float32):
        module = name.removesuffix(".weight")
        if module in ck.layers() and (W.shape, ck.spec.bits_of(module)) not in seen:
            seen.add((W.shape, ck.spec.bits_of(module)))
            out[module] = W
    return out


def serve_layer(ck: Checkpoint, module: str, W: torch.Tensor, family, rows: int = 3) -> str:
    """Layer ``module`` through ``family`` forced → the kernel that served it, or the family's refusal."""
    shape, W = tuple(W.shape), W[:MAX_ROWS]
    w = runtime_weight(ck.layer_tensors(module), ck.spec, module, shape, len(W), family)
    with forced(family.name):
        try:
            kernel = selector.select(w, torch.device("cpu"), torch.bfloat16)
        except ValueError as e:
            why = str(e)
            assert why.startswith(f"{selector.ENV_FORCE}={family.name}: ") and "\n" not in why, why
            return why
        x = torch.randn(rows, W.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
        y = kernel.apply(kernel.prepare(w), x).float()
    want = x.float() @ W.T
    err = float((y - want).norm() / want.norm().clamp_min(1e-30))
    assert err < TOLERANCE, f"{module} by {kernel.name}: relative error {err:.3g}"
    return kernel.name


def serve_checkpoint(path) -> dict[str, dict[str, str]]:
    """The serving check, then each distinct layer through each family → {family: {module: kernel or why}}."""
    from ..format.validate import verify_for_serving
    ck = verify_for_serving(path)["checkpoint"]   # what it verified, read as verified
    layers = distinct_layers(ck)
    return {fam.name: {m: serve_layer(ck, m, W, fam) for m, W in layers.items()} for fam in selector.families()}
