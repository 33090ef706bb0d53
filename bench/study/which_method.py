"""The README's "which method" table, generated from the study's results (docs/RESULTS.json):
every configuration on the served-bits front of the GPU (Triton) kernels of either model, with
the latq-quantize options that make it and its perplexity at the bits it serves on each model.

    python -m bench.study.which_method [docs/RESULTS.json]     # prints the table
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .curves import global_front, series_of
from .served import served_bits
from .summary import fmt_ppl

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "RESULTS.json"
DEFAULTS = {"method": "gptq", "bits": 4, "group_size": 64}   # latq-quantize's own defaults
MIN_BITS = 3.0   # below 3 served bits no configuration is near bf16 on these models: left to the report


def options(r: dict) -> str:
    """The latq-quantize flags that reproduce result ``r`` (those that differ from the defaults)."""
    o = dict(r["options"])
    o.setdefault("group_size", 128 if o.get("method") in ("gptq", "rtn", "ssqr") and "bits" in o else None)
    flags = [f"--method {o['method']}"] if o["method"] != DEFAULTS["method"] else []
    for key in ("bits", "group_size", "outlier_rate", "target_bits", "scale_bits"):
        if o.get(key) is not None and o[key] != DEFAULTS.get(key):
            flags.append(f"--{key.replace('_', '-')} {o[key]:g}")
    flags += ["--target-correction"] * bool(o.get("target_correction"))
    if o.get("rotate", "none") != "none":
        flags.append(f"--rotate {o['rotate']}")
    return "`" + " ".join(flags) + "`" if flags else "(defaults)"


def table(by_model: dict[str, list[dict]], family: str = "triton") -> list[str]:
    """Markdown rows: the configurations on ``family``'s served-bits front of any model, by served
    bits on the first model; each model's cell "ppl @ served bits", ★ where on that model's front."""
    models = list(by_model)
    fronts = {m: global_front(res, family) for m, res in by_model.items()}
    labels = {lab for f in fronts.values() for lab in f}
    recs = {m: {r["label"]: r for r in res if series_of(r)} for m, res in by_model.items()}
    rows = []
    for label in labels:
        cells = []
        for m in models:
            r = recs[m].get(label)
            b = served_bits(r, family) if r else None
            cells.append("—" if b is None else f"{fmt_ppl(r['ppl'])} @ {b:.3f}" + (" ★" if label in fronts[m] else ""))
        first = recs[models[0]].get(label) or recs[models[-1]][label]
        bits = served_bits(first, family)
        if bits is not None and bits >= MIN_BITS:
            rows.append((bits, f"| {label} | {options(first)} | " + " | ".join(cells) + " |"))
    bf16 = " | ".join(fmt_ppl(next(r["ppl"] for r in by_model[m] if r["label"] == "bf16")) + " @ 16"
                      for m in models)
    return (["| configuration | latq-quantize options | " + " | ".join(models) + " |",
             "|---|---|" + "---|" * len(models), f"| bf16 | (unquantized) | {bf16} |"]
            + [row for _, row in sorted(rows, reverse=True)])


def load(path: Path = RESULTS) -> dict[str, list[dict]]:
    return json.loads(Path(path).read_text())["results"]


if __name__ == "__main__":
    print("\n".join(table(load(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))))
