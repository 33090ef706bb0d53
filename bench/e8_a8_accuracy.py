"""What the opt-in ``cpu-e8-a8`` kernel costs in perplexity: a codebook checkpoint's perplexity with every
quantized linear's input as the exact kernel multiplies it, then as ``cpu-e8-a8`` does — rotated, each row
rounded to int8 a block of 64 columns (``round_to_int8``), back — on the same windows, in one run.

The model holds the checkpoint's dequantized weights (``latq-eval``'s reading, fp32 forwards); a hook on
each quantized linear rounds its input in the layer's rotated frame, which is the kernel's arithmetic up to
fp32 summation order (``tests/kernels/test_cpu_codebook_a8.py`` checks the kernel against the same rounding).

    python -m bench.e8_a8_accuracy CKPT                 # 64 windows of 512 tokens of the eval split
    python -m bench.e8_a8_accuracy CKPT --nwindows 8

Ends with ``HEADLINE ppl_exact=… ppl_a8=… a8_over_exact=…``.
"""
from __future__ import annotations

import argparse

import torch


def round_inputs(model, ck) -> list:
    """Hooks on ``ck``'s quantized linears in ``model``: each input rounded as ``cpu-e8-a8`` rounds it."""
    from vllm_latq.format.rotation import rotate, unrotate
    from vllm_latq.kernels.cpu.codebook import a8_block, round_to_int8

    rotation = ck.spec.rotation
    hooks = []
    for name in ck.layers():
        layer = model.get_submodule(name)
        signs = None if rotation is None else rotation.signs(layer.in_features)
        block = a8_block(ck.spec.group_size, layer.in_features)

        def pre(_, args, signs=signs, block=block):
            x = args[0]
            if signs is None:
                return (round_to_int8(x, block).to(x.dtype),)
            return (unrotate(round_to_int8(rotate(x, signs), block), signs).to(x.dtype),)
        hooks.append(layer.register_forward_pre_hook(pre))
    return hooks


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="a latq codebook (method e8) checkpoint")
    ap.add_argument("--nwindows", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    a = ap.parse_args(argv)

    from vllm_latq import data
    from vllm_latq.commands.evaluate import load_for_eval
    from vllm_latq.format.checkpoint import Checkpoint

    ck = Checkpoint(a.ckpt)
    if ck.spec.kind != "codebook":
        raise SystemExit(f"{a.ckpt}: a {ck.spec.kind} checkpoint; cpu-e8-a8 serves codebook (method e8) layers")
    model, tok, info = load_for_eval(a.ckpt, progress=False)
    windows = data.eval_windows(tok, seqlen=a.seqlen, nwindows=a.nwindows, docs=data.read_documents("wiki", "eval"))
    with torch.no_grad():
        exact = data.perplexity(model, windows, progress=False)["ppl"]
        hooks = round_inputs(model, ck)
        a8 = data.perplexity(model, windows, progress=False)["ppl"]
        for h in hooks:
            h.remove()
    print(f"{a.ckpt}: {info['bits']:.3f} bits a weight, {len(windows)} windows of {a.seqlen} tokens, fp32 forwards")
    print(f"  exact kernels (cpu-e8)        {exact:.4f}")
    print(f"  int8 activations (cpu-e8-a8)  {a8:.4f}  ({100 * (a8 / exact - 1):+.2f} %)")
    print(f"HEADLINE ppl_exact={exact:.4f} ppl_a8={a8:.4f} a8_over_exact={a8 / exact:.4f}")


if __name__ == "__main__":
    main()
