"""``latq-quantize MODEL OUT``: quantize a Hugging Face causal LM (a directory of safetensors, a
``.gguf`` file, or a reference model name: gemma3-270m, smollm2-135m) into a latq checkpoint
(docs/FORMAT.md); ``latq-inspect OUT`` validates it, ``latq-eval OUT`` measures its perplexity."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import format as fmt
from ..quantize import ranks


class _TqdmHandler(logging.Handler):
    """Log lines printed above the progress bars instead of through them."""

    def emit(self, record):
        try:
            from tqdm.auto import tqdm
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover
            self.handleError(record)


def setup_logging(quiet: bool = False) -> None:
    log = logging.getLogger("vllm_latq")
    if not any(isinstance(h, _TqdmHandler) for h in log.handlers):
        h = _TqdmHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    if ranks.launched_ranks() > 1:   # under torchrun: whose line is whose
        for h in log.handlers:
            h.setFormatter(logging.Formatter(f"[rank {os.environ.get('RANK', '?')}] %(message)s"))


def _rate(s: str) -> float:
    """``0.01`` or ``1%``."""
    s = s.strip()
    return float(s[:-1]) / 100 if s.endswith("%") else float(s)


EXAMPLES = """examples:
  latq-quantize gemma3-270m ckpt/gemma-w4                        # GPTQ 4-bit, group 64 (the default)
  latq-quantize gemma3-270m ckpt/gemma-w4s --scale-bits 4        # its group scales coded: fewer served bits
  latq-quantize gemma3-270m ckpt/gemma-ssqr --method ssqr        # SSQR, 4-bit g128, 1% outliers, certified
  latq-quantize gemma3-270m ckpt/gemma-hptq --method hptq --target-bits 3.125
  latq-quantize gemma3-270m ckpt/gemma-w3r --bits 3 --group-size 16 --rotate hadamard   # rotated inputs
  latq-quantize gemma3-270m ckpt/gemma-e8 --method e8 --bits 3 --scale-bits 4   # E8 codebooks (rotated)
  latq-quantize ./my-llama ckpt/w3 --bits 3 --group-size 32 --nsamples 64
  latq-quantize ./my-llama ckpt/w3 ...                           # again after an interruption: it continues
  torchrun --nproc-per-node 8 -m vllm_latq.quantize ./my-llama ckpt/w4   # 8 ranks (one per GPU with --device cuda)
  OMP_NUM_THREADS=2 torchrun --nproc-per-node 2 -m vllm_latq.quantize ./my-llama ckpt/w4   # CPU: 2 ranks x 2 threads
"""

_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _size(s: str) -> int | None:
    """Bytes: ``8G``, ``512M``, ``8GiB``, ``1.5g``, ``0``; ``auto``: None."""
    t = s.strip().lower().removesuffix("ib").removesuffix("b")
    if t == "auto":
        return None
    unit = t[-1:] if t[-1:] in _SIZE_UNITS else ""
    try:
        n = float(t[:len(t) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 8G, 512M, 0, auto)") from None
    if not 0 <= n < 2 ** 63:   # inf and nan too
        raise argparse.ArgumentTypeError(f"a size must be in [0, 2^63) bytes, got {s!r}")
    return int(n)


def _lattice_arguments(g, d) -> None:
    """The options that change the lattice problem or its decoder: ``--rotate``, ``--decoder``."""
    from ..algorithms.decoders import DECODERS
    g.add_argument("--rotate", default=None, choices=("none",) + fmt.rotation.KINDS,
                   help="hadamard: rotate every quantized linear's input by a seeded random-sign block Hadamard "
                        "matrix R and quantize W·R (incoherence processing: outlier columns spread out); served "
                        "as x·R through latq's kernels. Default hadamard for e8 (which needs it), none for the "
                        "others")
    g.add_argument("--rotate-seed", type=int, default=d.rotate_seed, help="the rotation's seed (default 0)")
    g.add_argument("--decoder", default=d.decoder, choices=DECODERS,
                   help="gptq/babai/ssqr/hptq: the lattice decoder. babai: GPTQ's nearest plane (default); kbest: a "
                        "beam of --beam paths; klein: --beam randomized nearest-plane draws. Each row keeps the "
                        "closer of the decoder's point and Babai's, at about --beam times the solve time")
    g.add_argument("--beam", type=int, default=d.beam, help="kbest's beam width / klein's draws (default 4)")


def parser() -> argparse.ArgumentParser:
    from ..quantize.options import (COMPUTE_DTYPES, DEFAULT_GROUP_SIZE, DEFAULT_LM_HEAD_BITS, ORDERS, QuantizeOptions,
                                    default_group_size)
    d = QuantizeOptions()
    ap = argparse.ArgumentParser(prog="latq-quantize", description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="HF model directory, .gguf file, or a name: gemma3-270m, smollm2-135m")
    ap.add_argument("out", help="output checkpoint directory (written as OUT.tmp-latq, then renamed)")
    g = ap.add_argument_group("method")
    g.add_argument("--method", default=d.method, choices=fmt.METHODS,
                   help="gptq (the default: clipped b-bit groups, the best perplexity per served bit in "
                        "the study), ssqr (b-bit groups + CSR outliers, unclipped: the no-clipping certificate), "
                        "hptq (Huffman, one scale, certified), baselines rtn, hrtn, babai (clipped Babai ≡ GPTQ "
                        "reversed), e8 (E8 vector codes on 8-column blocks by block Babai, rotated by default; "
                        "served by latq's plugin, no export)")
    g.add_argument("--bits", type=int, default=d.bits, help="inlier bits for ssqr/gptq/rtn/babai (2..8, default 4); "
                   "e8: the code's bits a weight (2, 3 or 4)")
    g.add_argument("--group-size", type=int, default=None,
                   help=f"group size along the input dimension (default {', '.join(sorted(DEFAULT_GROUP_SIZE))}: "
                        f"{d.group_size}, the others {default_group_size('')}; a ragged last group is allowed)")
    g.add_argument("--outlier-rate", type=_rate, default=d.outlier_rate,
                   help="ssqr outlier budget, e.g. 0.01 or 1%% (default 0.01)")
    g.add_argument("--target-bits", type=float, default=d.target_bits,
                   help="hptq/hrtn target bits/weight, everything counted (default 3.125)")
    g.add_argument("--order", default=d.order, choices=ORDERS,
                   help="column order (default act)")
    g.add_argument("--target-correction", action="store_true",
                   help="solve each block linear against W' = W + (X~'X~ + λI)^-1 (X~'X - X~'X~) W, which maps "
                        "its inputs X~ (quantized prefix) to the full-precision outputs XW (a second activation "
                        "stream, one more forward per sequence; calibrated methods)")
    g.add_argument("--damp", type=float, default=d.damp, help="Hessian damping λ = damp·mean(diag H) (default 0.01)")
    g.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="quantize the output head with the layers' own bits (Hessian from the final norm's outputs), "
                        "or with --no-quantize-lm-head keep it in the model dtype. Default: dense methods quantize "
                        f"it with {DEFAULT_LM_HEAD_BITS}-bit inliers (no measurable perplexity cost, half the bytes "
                        "it streams per token: docs/RESULTS.md), hptq/hrtn keep it. A tied head gets its own copy "
                        "(untied; the embedding stays in the model dtype for the lookup) only where the checkpoint "
                        "stays smaller than the source; asked for, always")
    g.add_argument("--lm-head-bits", type=int, default=None, metavar="N",
                   help="quantize the output head with N-bit inliers (implies --quantize-lm-head; dense methods; "
                        f"default {DEFAULT_LM_HEAD_BITS})")
    g.add_argument("--column-scales", default=d.column_scales, choices=("none",) + fmt.COLUMN_SCALE_FOLDS,
                   help="norm: per-input-column scales c ∝ sqrt(D) folded into the norms feeding q/k/v and "
                        "gate/up (free at serving time; needs a calibrated method). Default none")
    g.add_argument("--scale-bits", type=int, default=None, choices=(4,),
                   help="gptq/rtn/babai/e8: store (and serve) the group scales as 4-bit codes on a grid per 16 rows "
                        "(6 bits per scale instead of 16: group 64 then costs fewer bits than fp16 group 128)")
    _lattice_arguments(ap.add_argument_group("lattice"), d)
    c = ap.add_argument_group("calibration")
    c.add_argument("--calib", default=d.calib,
                   help="'wiki' (shipped Wikipedia summaries, calibration split) or a .txt / .jsonl file")
    c.add_argument("--nsamples", type=int, default=d.nsamples, help="calibration sequences (default 128)")
    c.add_argument("--seqlen", type=int, default=d.seqlen, help="tokens per sequence (default 512)")
    c.add_argument("--seed", type=int, default=d.seed, help="calibration shuffle seed (default 0)")
    c.add_argument("--moe-min-tokens", type=int, default=d.moe_min_tokens, metavar="N",
                   help="mixture-of-experts: an expert routed fewer calibration tokens gets its Hessians blended with "
                        f"all the block's tokens (default {d.moe_min_tokens})")
    c.add_argument("--moe-route-all", action="store_true",
                   help="mixture-of-experts: calibrate every expert on every token, not only those routed to it")
    r = ap.add_argument_group("run")
    r.add_argument("--device", default=d.device, help="torch device for blocks and solvers (default cpu)")
    r.add_argument("--compute-dtype", default=d.compute_dtype, choices=tuple(COMPUTE_DTYPES),
                   help="dtype of the calibration forwards (default auto: the model's, bf16 for a bf16 "
                        "model, as GPTQ runs, or float32 on a CPU that only emulates bf16)")
    r.add_argument("--max-activation-memory", type=_size, default=d.max_activation_memory, metavar="SIZE",
                   help="memory for the calibration activations (nsamples x seqlen x hidden in the forwards' "
                        "dtype), e.g. 8G; beyond it they are spilled to OUT.tmp-latq and read one sequence at a "
                        "time (default auto: half the memory available at the start; 0: always spill)")
    r.add_argument("--resume", action="store_true",
                   help="continue an interrupted run from its last finished block (the same command run again does so "
                        "by itself); with it, --overwrite never discards a partial run")
    r.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it exists, and discard a partial run (OUT.tmp-latq) that cannot be continued: "
                        "another source or other options")
    r.add_argument("--no-validate", action="store_true", help="skip the final validation of the checkpoint")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.add_argument("-q", "--quiet", action="store_true", help="no per-layer log lines")
    return ap


def main(argv=None) -> int:
    from ..errors import COMMAND_HEADROOM, limits
    from ..hf_model import UnsupportedModelError
    from ..quantize.faults import SimulatedInterruption
    from ..quantize.options import QuantizeOptions
    from ..quantize.pipeline import quantize_model
    from .environment import bad_environment

    a = parser().parse_args(argv)
    setup_logging(a.quiet)
    if bad_environment("latq-quantize"):
        return 2
    try:
        with limits(f"quantizing {a.model}", need=COMMAND_HEADROOM):
            opts = QuantizeOptions(method=a.method, bits=a.bits, group_size=a.group_size,
                                   outlier_rate=a.outlier_rate, target_bits=a.target_bits, order=a.order,
                                   damp=a.damp, calib=a.calib,
                                   nsamples=a.nsamples, seqlen=a.seqlen, seed=a.seed, device=a.device,
                                   compute_dtype=a.compute_dtype, max_activation_memory=a.max_activation_memory,
                                   quantize_lm_head=a.quantize_lm_head,
                                   lm_head_bits=a.lm_head_bits, moe_min_tokens=a.moe_min_tokens,
                                   moe_route_all=a.moe_route_all, column_scales=a.column_scales,
                                   target_correction=a.target_correction, scale_bits=a.scale_bits,
                                   rotate=a.rotate, rotate_seed=a.rotate_seed, decoder=a.decoder, beam=a.beam)
            out = quantize_model(a.model, a.out, opts, resume=a.resume, overwrite=a.overwrite,
                                 progress=not a.no_progress, validate=not a.no_validate)
    except ranks.RankFailed as e:
        # one rank says it; rank 0 may be the lost one
        if os.environ.get("RANK", "0") == "0" or "stopped answering" in str(e):
            print(f"latq-quantize: {e}; the finished blocks are kept: rerun with --resume (any number of ranks)",
                  file=sys.stderr)
        return 1
    except SimulatedInterruption as e:
        print(f"latq-quantize: {e}; rerun the same command to continue", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("latq-quantize: interrupted; rerun the same command to continue from the last finished block",
              file=sys.stderr)
        return 130
    except (UnsupportedModelError, OSError, ValueError, ModuleNotFoundError) as e:
        if not isinstance(e, ranks.RanksDisagree) or os.environ.get("RANK", "0") == "0":   # said once
            print(f"latq-quantize: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        from ..format.manifest import digest_of
        d = digest_of(out)
        print(f"latq-quantize: sealed {out}, digest {d}\n  hand it on with the checkpoint, and pin it where it is "
              f"read: latq-serve {out} --expect-digest {d} (latq-inspect, latq-eval, latq-export take it too; "
              f"LATQ_EXPECT_DIGEST for vllm serve)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
