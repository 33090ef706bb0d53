"""How the report states result records, shared by its sections: perplexities and their change
as text, and the certificate over every layer quantized without clipping."""
from __future__ import annotations

import math
import statistics

from .configs import E8_FAMILY


def fmt_ppl(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x:.3g}" if x >= 1e4 else f"{x:.2f}"


def fmt_delta(ratio: float) -> str:
    """Perplexity change vs bf16: a percentage, or a factor once it is past ×10."""
    return f"{100 * (ratio - 1):+.1f}%" if ratio < 10 else f"×{ratio:.3g}"


def cert_summary(results: list[dict]) -> dict | None:
    """Measured error / bound over the certificate records of ``results``: min, median, mean and
    max of the per-layer ratio, the largest per-row ratio (None without records). E8's records are left
    out: its bound is the codebook's (covering radius, overloaded blocks), not ¼ΣD s²."""
    recs = [c for r in results if r.get("family") != E8_FAMILY for c in r.get("certificate", [])]
    if not recs:
        return None
    lr = [c["layer_ratio"] for c in recs]
    rm = [c["row_max"] for c in recs]
    return {"layers": len(recs), "ratio_min": min(lr), "ratio_median": statistics.median(lr),
            "ratio_mean": statistics.fmean(lr), "ratio_max": max(lr), "row_max": max(rm)}
