"""``latq-inspect CKPT``: validate a checkpoint and print each layer's served bits per kernel family."""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import COMMAND_HEADROOM, FormatError, ResourceLimit, limits
from ..format.manifest import SKIPPED
from .environment import bad_environment
from ..format.validate import format_report, validate_checkpoint


def inspect_main(argv=None) -> int:
    """``latq-inspect CKPT``: validate a checkpoint and print its per-layer table.
    Exit code 0 if valid, 2 with one error line naming file and tensor otherwise."""
    ap = argparse.ArgumentParser(prog="latq-inspect", description=inspect_main.__doc__)
    ap.add_argument("checkpoint")
    ap.add_argument("--no-decode", action="store_true", help="skip decoding the Huffman streams (faster)")
    ap.add_argument("--expect-digest", metavar="SHA256",
                    help="refuse the checkpoint unless its manifest has this digest (what latq-quantize printed): "
                         "an edit sealed again is then refused too")
    ap.add_argument("--no-verify", "--no-checksums", dest="no_verify", action="store_true",
                    help="skip the sha256 checks (tensors, every file against latq_manifest.json): for a checkpoint "
                         "edited on purpose; shapes and values are checked all the same")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-served", action="store_true",
                    help="skip the served bits/weight per kernel family (needs vllm_latq.kernels)")
    ap.add_argument("--no-progress", action="store_true",
                    help="say nothing while verifying and computing the served bits (else bars on a terminal, a line "
                         "per step on stderr otherwise)")
    a = ap.parse_args(argv)
    if bad_environment("latq-inspect"):
        return 2
    if a.no_verify:
        print(f"latq-inspect: --no-verify: {SKIPPED}", file=sys.stderr)
    try:
        with limits(f"validating {a.checkpoint}", need=COMMAND_HEADROOM):
            report = validate_checkpoint(a.checkpoint, decode=not a.no_decode, verify_checksums=not a.no_verify,
                                         progress=not a.no_progress, expect_digest=a.expect_digest)
    except FormatError as e:
        print(f"latq-inspect: invalid checkpoint {a.checkpoint}: {e}", file=sys.stderr)
        return 2
    except (ValueError, ResourceLimit) as e:   # --expect-digest malformed, or beside --no-verify; a limit reached
        print(f"latq-inspect: error: {e}", file=sys.stderr)
        return 2
    ck = report.pop("checkpoint")   # what was verified, its files open: read from it, not again by path
    if report["unsealed"]:
        print(f"latq-inspect: not sealed, read by no loader: {', '.join(report['unsealed'])}", file=sys.stderr)
    if not a.no_served:
        # the kernels' cost models: imported only when asked for, so validating needs no kernels
        from ..kernels.served_report import checkpoint_served
        try:
            with limits(f"computing the served bits of {a.checkpoint}"):
                report["totals"]["served_bits_per_weight"] = checkpoint_served(ck, report["layers"],
                                                                                not a.no_progress)
        except FormatError as e:
            print(f"latq-inspect: invalid checkpoint {a.checkpoint}: {e}", file=sys.stderr)
            return 2
        except ResourceLimit as e:
            print(f"latq-inspect: error: {e}", file=sys.stderr)
            return 2
    if a.json:
        out = {k: v for k, v in report.items() if k != "spec"}
        out["quantization_config"] = ck.config["quantization_config"]
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report))
        sealed = "" if a.no_verify else f", sealed: digest {report['digest']}" + (
            " (the one pinned)" if a.expect_digest else "")
        print(f"OK: {a.checkpoint} is a valid latq checkpoint{sealed}")
    return 0


def main():  # pragma: no cover - console script
    sys.exit(inspect_main())


if __name__ == "__main__":  # pragma: no cover
    main()
