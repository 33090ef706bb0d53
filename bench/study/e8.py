"""The E8 rows of the report: each E8 codebook configuration (block Babai) against rotated GPTQ with
the same scales (its ``base``), read against the 3-bit noise floor (E8's own calibration draws and
our GPTQ's), and the claims that E8 reaches GPTQ-4b's perplexity, plain and rotated, at fewer
Triton-served bits — judged by the claims' one rule (:func:`~.records.by_floor`)."""
from __future__ import annotations

import math
from dataclasses import replace

from .configs import BASE_FAMILY, E8_FAMILY, NOISE_TAGS, e8_configs
from .curves import series_of
from .records import NOISE, base_label, by_floor, lower_by_floor, noise_floor, pct, ppl_of, record
from .served import fallback_only, served_bits
from .summary import fmt_ppl

SEEDED = "E8-3b-rot-s4-g16"   # the E8 configuration run on other calibration draws
CLAIM_BITS = 3.5   # the claim's budget: Triton-served bits/weight
# the perplexities it has to reach (group size 128): our GPTQ-4b, and the strongest 4-bit baseline at
# about its bits, GPTQ-4b rotated
CLAIM_BASES = ("GPTQ-4b", "GPTQ-4b-rot")
FAMILIES = {"triton": "T", "cpu": "C"}   # served-bits columns


def seed_spread(res: list[dict]) -> tuple[float, list[float]] | None:
    """The largest ratio between two calibration draws of :data:`SEEDED` (seed 0 and the noise
    seeds), and their perplexities; None with fewer than two."""
    ppls = [p for t in ("", *(f"-{t}" for t in NOISE_TAGS)) if (p := ppl_of(res, SEEDED + t)) is not None]
    return None if len(ppls) < 2 else (max(ppls) / min(ppls) - 1, ppls)


def floor_at(res: list[dict], level: int) -> float | None:
    """The noise floor an E8 comparison at ``level`` bits is read against: the larger of our GPTQ's
    at that width and (3 bits) E8's own seed spread; None where neither was measured."""
    floors = [nf[0] for nf in [noise_floor(res, level)] if nf]
    if level == 3 and (sp := seed_spread(res)):
        floors.append(sp[0])
    return max(floors, default=None)


def served_cell(r: dict, family: str) -> str:
    """A record's served bits in ``family``, or why there are none."""
    b = served_bits(r, family)
    if b is not None:
        return f"{b:.3f}"
    return "n/a (bf16 fallback: no codebook kernel)" if fallback_only(r, family) else "n/a"


def verdict(res: list[dict], e8: dict, base: dict) -> str:
    """"beats", "within noise" or "loses": the log-ppl gap against the floor at E8's width."""
    nf = floor_at(res, e8["level"])
    if nf is None:
        return f"— (no noise floor at {e8['level']} bits)"
    return {True: "beats", False: "loses", NOISE: NOISE}[by_floor(math.log(e8["ppl"] / base["ppl"]), nf)]


def _pair(res: list[dict], label: str, base: str) -> str:
    """One table row: E8 ``label`` against ``base``, each cell "base → E8" ("not run" for a side
    without a result)."""
    e8, b = record(res, label), record(res, base)

    def both(value) -> str:
        return " → ".join("not run" if r is None else value(r) for r in (b, e8))
    cells = [both(lambda r: f"{r['bits']:.3f}"), *(both(lambda r, f=f: served_cell(r, f)) for f in FAMILIES),
             both(lambda r: fmt_ppl(r["ppl"]))]
    cells += [pct(e8["ppl"] / b["ppl"] - 1), verdict(res, e8, b)] if e8 and b else ["", ""]
    return f"| {label} | {base} | " + " | ".join(cells + [certificate_cell(e8)]) + " |"


def certificate_cell(r: dict | None) -> str:
    """An E8 result's overloaded blocks (% of all) and its certificate's largest measured / bound over
    the rows without one (from the checkpoint's stats)."""
    over = (r or {}).get("overloads")
    if not over:
        return "not recorded"
    cert = r.get("stats_cert_max")
    return (f"{100 * over['blocks'] / over['of']:.1f} % · "
            + ("no row covered" if cert is None
               else f"≤ {cert:.3f} ({over['certified_layers']}/{over['layers']} layers)"))


def _floor_lines(model: str, res: list[dict]) -> list[str]:
    """The floors a model's E8 rows are read against, as text."""
    sp, nf = seed_spread(res), noise_floor(res, 3)
    seeds = " and ".join(f"-{t}" for t in NOISE_TAGS)
    own = (f"±{100 * sp[0]:.2f}% ({SEEDED} over {len(sp[1])} calibration draws: "
           f"{', '.join(fmt_ppl(p) for p in sp[1])})" if sp
           else f"not measured ({SEEDED}{seeds} not run)")
    gptq = f"±{100 * nf[0]:.2f}% ({nf[1]})" if nf else "not measured"
    return [f"{model}: 3-bit noise floor, E8's own {own}; our GPTQ's {gptq}."]


def e8_section(by_model: dict[str, list[dict]]) -> list[str]:
    """The report's E8 section: per model every E8 configuration of the study (run or not) against
    its base, "base → E8" in each column, with the verdict by the floor at its width."""
    L = ["## E8 codebooks (block Babai)", "",
         "Each E8 configuration (`--method e8`: 8-column blocks rounded to an E8 lattice codebook by block "
         "Babai, b bits a weight of code, 4-bit coded scales per 16 or 64 columns, rotated) against rotated "
         "GPTQ with the same scales (the same served bits where each family has a kernel for both). Each "
         "column reads \"base → E8\"; stored bits from the checkpoints' accounting, served bits (T: Triton, "
         "C: CPU) from the kernels' cost models (n/a: not computed, or no codebook kernel in that family, "
         "whose layers it dequantizes to bf16). Verdict: beats / loses where the log-ppl gap is beyond the "
         "noise floor at the row's width (at 3 bits the larger of E8's own spread over calibration draws and "
         "our GPTQ's), else within noise. Overloads · cert: the blocks whose target lay beyond the codebook's "
         "covering radius (the certificate does not cover their rows), and the largest measured error / bound over "
         "the rows it covers, with the layers that have such a row.", ""]
    for model, res in by_model.items():
        L += _floor_lines(model, res) + [""]
        L += [f"| {model}: E8 | compared with | stored b | served T | served C | ppl | Δ ppl | verdict | "
              "overloads · cert |", "|---|---|---|---|---|---|---|---|---|"]
        bases = {c.label: replace(c, family=BASE_FAMILY[c.family], tag=c.base).label for c in e8_configs(model)}
        bases.update({r["label"]: base_label(res, r["label"]) for r in res if r["family"] == E8_FAMILY})
        L += [_pair(res, label, base) for label, base in bases.items()]
        L.append("")
    return L


def e8_claim(row) -> None:
    """The claims rows: the best E8 operating point at ≤ :data:`CLAIM_BITS` Triton-served bits per
    model reaches each of :data:`CLAIM_BASES`' perplexity — lower by more than the noise floor at
    the base's width (4 bits), "within noise" inside it."""
    for base in CLAIM_BASES:
        row(f"an E8 configuration at ≤ {CLAIM_BITS:g} Triton-served bits reaches {base}-g128's perplexity (the "
            f"best such E8 point's ppl lower than {base}'s by more than the 4-bit noise floor; inside it: within "
            "noise)", "—", _reaches(base))


def _reaches(base: str):
    """A claims cell: the best E8 point at ≤ :data:`CLAIM_BITS` Triton-served bits against ``base``."""
    def cell(res, _):
        target = record(res, base)
        e8 = [r for r in res if r["family"] == E8_FAMILY and series_of(r) and math.isfinite(r["ppl"])]
        if target is None or not e8:
            return None
        served = [r for r in e8 if served_bits(r, "triton") is not None]
        if not served:
            fallback = any(fallback_only(r, "triton") for r in e8)
            why = "no codebook kernel (bf16 fallback)" if fallback else "not computed"
            return f"no Triton served bits for E8: {why}", None
        fits = [r for r in served if served_bits(r, "triton") <= CLAIM_BITS]
        if not fits:
            least = min(served, key=lambda r: served_bits(r, "triton"))
            return (f"no E8 point at ≤ {CLAIM_BITS:g} b (fewest: {least['label']} at "
                    f"{served_bits(least, 'triton'):.3f} b)"), False
        best = min(fits, key=lambda r: r["ppl"])
        tb = served_bits(target, "triton")
        text = (f"{best['label']} {fmt_ppl(best['ppl'])} at {served_bits(best, 'triton'):.3f} b vs {base} "
                f"{fmt_ppl(target['ppl'])}" + (f" at {tb:.3f} b" if tb is not None else "")
                + f" ({pct(best['ppl'] / target['ppl'] - 1)})")
        v = lower_by_floor(res, target["level"], math.log(best["ppl"] / target["ppl"]))
        if v is None:
            return text + f": no noise floor at {target['level']} bits", None
        nf = noise_floor(res, target["level"])[0]
        return text + (f" — within noise (±{100 * nf:.2f} %)" if v == NOISE else ""), v
    return cell
