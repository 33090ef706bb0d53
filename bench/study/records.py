"""One model's study records, read for the claims: a record by label, perplexity ratios, a
variant's base, our GPTQ's spread and noise floor at a bit width, its curve in a kernel family."""
from __future__ import annotations

import math

from .configs import BASE_FAMILY, NOISE_TAGS, SPREAD_TAGS
from .curves import frontier, points, series_of


def record(res: list[dict], label: str) -> dict | None:
    return next((r for r in res if r["label"] == label), None)


def ppl_of(res: list[dict], label: str) -> float | None:
    r = record(res, label)
    return None if r is None else r["ppl"]


def ratio(res: list[dict], label: str, base: str | None = "bf16") -> float | None:
    a, b = ppl_of(res, label), ppl_of(res, base)
    return None if a is None or b is None else a / b - 1


def base_label(res: list[dict], label: str) -> str | None:
    """The label of the configuration the variant ``label`` is compared with (of its family, or of
    the family :data:`~.configs.BASE_FAMILY` names: E8's base is rotated GPTQ)."""
    r = record(res, label)
    if r is None:
        return None
    head = r["label"].removesuffix("-" + r["tag"])
    if r["family"] in BASE_FAMILY:
        head = BASE_FAMILY[r["family"]] + head.removeprefix(r["family"])
    return head + (f"-{r['base']}" if r.get("base") else "")


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%" if abs(x) < 9 else f"×{1 + x:.3g}"


def spread_of(res: list[dict], b: int) -> dict:
    """How far ours' GPTQ-b perplexity moves under the harmless changes: {tag: Δ}."""
    return {t: d for t in SPREAD_TAGS if (d := ratio(res, f"GPTQ-{b}b-{t}", f"GPTQ-{b}b")) is not None}


def noise_floor(res: list[dict], level: int) -> tuple[float, str] | None:
    """The noise floor of a comparison at ``level`` bits: how far our GPTQ at that width moves
    (the largest ratio between two of its runs) under other calibration draws and the harmless controls
    (:data:`SPREAD_TAGS`); None where neither ran at that width — a floor measured at more bits
    would understate it."""
    base = ppl_of(res, f"GPTQ-{level}b")
    seeds = [p for t in NOISE_TAGS if (p := ppl_of(res, f"GPTQ-{level}b-{t}")) is not None]
    controls = [p for t in SPREAD_TAGS if (p := ppl_of(res, f"GPTQ-{level}b-{t}")) is not None]
    if base is None or not (seeds or controls):
        return None
    runs = [base, *seeds, *controls]
    what = [f"{len(seeds) + 1} calibration draws"] * bool(seeds) + ["the harmless controls"] * bool(controls)
    # the largest gap between two runs of the same method: what a comparison of two runs can show by chance
    return max(runs) / min(runs) - 1, f"GPTQ-{level}b over " + " and ".join(what)


# a judged comparison inside the noise floor: neither holds nor fails (the claims' third verdict)
NOISE = "within noise"


def by_floor(gap: float, floor: float) -> bool | str:
    """The one rule every "A beats / reaches B" is judged by: True where the log-ppl ``gap`` (A against
    B) is lower by more than the noise ``floor`` (a ratio, e.g. 0.014), False where higher by more,
    else :data:`NOISE`."""
    return True if gap < -math.log1p(floor) else False if gap > math.log1p(floor) else NOISE


def lower_by_floor(res: list[dict], level: int | None, gap: float) -> bool | str | None:
    """:func:`by_floor` with the noise floor our GPTQ measured at ``level`` bits; None: no floor
    measured at that width (no verdict then — a floor measured at more bits would understate it)."""
    nf = noise_floor(res, level) if level else None
    return None if nf is None else by_floor(gap, nf[0])


def gptq_curve(res: list[dict], family: str) -> list:
    """Our GPTQ's curve in ``family``: the non-dominated points over every group size run."""
    names = {s for r in res if r["family"] == "GPTQ" and (s := series_of(r)) and s.startswith("GPTQ g")}
    return frontier(points(res, names, family))


def spread_max(sp: dict) -> float:
    """How far ours moved under the harmless changes ``sp`` ({tag: Δ}) at most (0 if none ran)."""
    return max(map(abs, sp.values()), default=0.0)
