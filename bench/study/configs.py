"""The study's configurations: what runs (models, bit levels, method families, tagged variants)
and in which order, as :class:`Config` records the runner quantizes and the report groups."""
from __future__ import annotations

from dataclasses import dataclass

MODELS = ("gemma3-270m", "smollm2-135m")
LEVELS = (4, 3, 2)  # table columns: ≈4.125 / 3.125 / 2.125 bits (SSQR: 4/3/2-bit inliers)
FAMILIES = ("RTN", "GPTQ", "HRTN", "HPTQ", "SSQR-1%", "SSQR-2%")
# GPTQ's group sizes besides the default 128: the baselines of the served-bits Pareto
GROUP_SIZES = (32, 64)
# the noise floor at each bit width: our GPTQ calibrated on other seeded draws of the calibration
# text (which articles, in which order): a harmless change whose perplexity spread sizes every verdict
# at that width (fewer bits, more noise: a 4-bit floor would understate a 2-bit one)
NOISE_SEEDS = (1, 2)
NOISE_TAGS = tuple(f"seed{s}" for s in NOISE_SEEDS)
# the target-correction lever (Qronos): our GPTQ solved against
# the full-precision outputs, at each group size of the baselines — same served bits as plain GPTQ
TC_TAGS = {"tc": 128, **{f"tc-g{g}": g for g in GROUP_SIZES}}
# second-level scales (--scale-bits 4): our GPTQ with 4-bit coded group scales at half
# and a quarter of the default group size, which serve about as many bits as the next larger
# fp16-scaled group: the lever that could put a smaller group's error at a larger group's cost
S4_TAGS = {f"s4-g{g}": g for g in (64, 32, 16)}
# incoherence processing (--rotate hadamard): each rotated configuration against the same one
# unrotated, tag "rot" + its base's tag; GPTQ at every group size, SSQR-1 %, HPTQ, and coded scales in
# the form that leads the unrotated 3-bit front (g16); coded g64/g32 serve about the bits of fp16 g128/g64,
# which the grid rotates already
ROT_GPTQ_BASES = ("", "g64", "g32", "s4-g16")
# the strongest 3-bit candidate: rotation, target correction and coded scales together
ROT_TC_TAG = "rot-tc-s4-g16"


def rot_tag(base: str) -> str:
    """The tag of ``base``'s configuration rotated: ``rot`` or ``rot-<base>``."""
    return "rot" + (f"-{base}" if base else "")


ROT_TAGS = (*(rot_tag(b) for b in ROT_GPTQ_BASES), ROT_TC_TAG)
# E8 codebooks by block Babai (--method e8, rotation required): each level with 4-bit coded scales at
# group size 16 (the scalar 3-bit front's scales), against rotated GPTQ with the same scales (same
# served bits: a block's code is b bits a weight, like b-bit integers); at 3 bits also coarser scales
# (g64), target correction, and the noise floor of other calibration draws
E8_FAMILY = "E8"
BASE_FAMILY = {E8_FAMILY: "GPTQ"}   # a family whose configurations are compared with another family's
E8_TAGS = {"rot-s4-g16": 16, "rot-s4-g64": 64, "rot-tc-s4-g16": 16,
           **{f"rot-s4-g16-{t}": 16 for t in NOISE_TAGS}}
# configurations that change one option of a default one: (tag, report heading, column name)
TAGGED = (("min-pivot", "Perplexity of min-pivot vs act-order (the pipeline's default):", "min-pivot"),
          ("lm-head", "The output head quantized too (`--quantize-lm-head`; bits/w then count the head, "
                      "which SmolLM2 and Gemma3 tie to the embedding, so the checkpoint unties it):", "+ lm_head"),
          ("lm-head8", "The output head quantized with 8-bit inliers (`--lm-head-bits 8`), the rest as the default:",
           "+ 8-bit lm_head"),
          ("g64-lm-head8", "latq-quantize's default (our GPTQ at group size 64) with its output head quantized with "
                           "8-bit inliers at group size 64 against the same with the head in bf16 (bits/w count the "
                           "head: the tied embedding stays bf16 for the lookup, the head is a separate copy):",
           "+ 8-bit lm_head"),
          ("peer", "Peer GPTQ, whole model: every layer's integers from the IST-DASLab reference column loop "
                   "(`reference_gptq`) instead of ours, all else equal (pipeline, Hessians, act-order, damping, "
                   "scales); the bar is ±1 %:", "reference loop"),
          ("g64", "Our GPTQ at group size 64 (a baseline of the served-bits Pareto; SmolLM2: also the largest "
                  "group size llm-compressor accepts for its 576 columns, the baseline of that comparison):",
           "group size 64"),
          ("llmc", "Peer GPTQ, whole model: llm-compressor's own GPTQ (`GPTQModifier`, its sequential pipeline and "
                   "`mse` scale observer, run in an environment of its own by `bench/peer_llmcompressor.py`) at our "
                   "settings: the same bf16 model and calibration sequences, symmetric signed integers, static "
                   "act-order, damping 0.01, blocks of 128 columns, its dequantized weights bf16(z·s) as it deploys "
                   "them; compared with ours at the same group size; the bar is ±1 %:", "llm-compressor"),
          ("llmc-scales", "Our GPTQ given llm-compressor's scales (its `mse` observer's, computed in its environment "
                          "from the bf16 weights, as its GPTQ run chooses them), everything else ours (pipeline, "
                          "solver, format), against llm-compressor's GPTQ: what is left of the gap once the scales "
                          "are equal:", "ours, its scales"),
          *((f"g{g}", f"Our GPTQ at group size {g} (a baseline of the served-bits Pareto):", f"group size {g}")
            for g in GROUP_SIZES if g != 64),
          *((t, f"Target correction (`--target-correction`: every block linear solved against the "
                f"full-precision outputs) at group size {g}, against our GPTQ at the same group size "
                f"(same served bits):", "target correction") for t, g in TC_TAGS.items()),
          *((t, f"Second-level scales (`--scale-bits 4`: group scales as 4-bit codes on a grid per 16 rows, "
                f"6 bits per scale instead of 16) at group size {g}, against our GPTQ at group size {2 * g} "
                f"(about the served bits):", "coded scales") for t, g in S4_TAGS.items()),
          *((rot_tag(b), "Incoherence processing (`--rotate hadamard`: every linear's input rotated by a seeded "
                         "random-sign block Hadamard, the integers solved in that frame) against the same "
                         + (f"configuration ({b})" if b else "configuration") + " unrotated:", "rotated")
            for b in ROT_GPTQ_BASES),
          (ROT_TC_TAG, "Rotation, target correction and 4-bit coded scales at group size 16 together, against "
                       "coded scales at group size 16 alone:", "rotated + TC"),
          *((t, f"Noise floor: our GPTQ calibrated on the seeded draw {t} of the calibration text instead of "
                "seed 0 (other articles, another order):", t) for t in NOISE_TAGS),
          ("fp64", "Control for the peer comparison: our GPTQ computed in fp64 instead of fp32 (same algorithm and "
                   "settings; only intermediate rounding differs, changing a few integers):", "ours in fp64"),
          ("damp-up", "Control: our GPTQ with the damping ×(1 + 10⁻⁴) (0.01 → 0.010001 of mean diag H: no change of "
                      "any meaning, but a few integers flip):", "damp +0.01 %"),
          ("damp-down", "Control: the damping ×(1 − 10⁻⁴):", "damp −0.01 %"),
          ("damp-up2", "Control: the damping ×(1 + 10⁻³):", "damp +0.1 %"),
          ("damp-down2", "Control: the damping ×(1 − 10⁻³):", "damp −0.1 %"),
          ("fp32-forwards", "Control: the calibration forwards in fp32 instead of the models' bf16 (activations "
                            "differ in their last bits):",
           "fp32 forwards"))
# harmless changes of our GPTQ-3b, each flipping a few integers: its spread, the peer gap's yardstick
SPREAD_TAGS = ("fp64", "damp-up", "damp-down", "damp-up2", "damp-down2", "fp32-forwards")
SPREAD_OPTS = {"fp32-forwards": {"compute_dtype": "float32"}}  # the spread controls that are an option
# beyond the core study (sweep, ordering, min-pivot, peer): the peer gap's controls and the CPU
# decode head options; `--core` skips them
HEAD_TAGS = ("lm-head", "lm-head8", "g64-lm-head8")
EXTRA_TAGS = SPREAD_TAGS + HEAD_TAGS
# the peer GPTQs, the group-size-64 baseline of llm-compressor's, and ours given its scales
PEER_TAGS = ("peer", "llmc", "g64", "llmc-scales")


@dataclass(frozen=True)
class Config:
    model: str
    family: str  # "bf16" or one of FAMILIES
    level: int | None  # bit level (table column); None for bf16
    opts: tuple = ()  # QuantizeOptions keyword arguments, as sorted (key, value) pairs
    tag: str = ""  # e.g. "min-pivot" for the ordering ablation
    base: str = ""  # the tag of the configuration this one is compared with ("": the default one)

    @property
    def label(self) -> str:
        if self.family == "bf16":
            return "bf16"
        lvl = f"{self.level}b" if self.family in ("RTN", "GPTQ", E8_FAMILY) or self.family.startswith("SSQR") \
            else f"{self.level}.125"
        return f"{self.family}-{lvl}" + (f"-{self.tag}" if self.tag else "")

    @property
    def slug(self) -> str:
        return slug(self.label)

    @property
    def kwargs(self) -> dict:
        return dict(self.opts)


def slug(label: str) -> str:
    """A configuration's file name in the cache: ``SSQR-1%-4b`` → ``ssqr-1pct-4b``."""
    return label.lower().replace("%", "pct").replace(".", "p")


def make_config(model, family, level, tag="", *, base="", **opts) -> Config:
    """A :class:`Config` with ``opts`` (QuantizeOptions keyword arguments) as its options."""
    return Config(model, family, level, tuple(sorted(opts.items())), tag, base)


def peer_group_size(model_config: dict, group_size: int) -> int:
    """The largest group size ≤ ``group_size`` (halving) that divides every linear's input width:
    llm-compressor's group quantization refuses ragged groups (SmolLM2's 576 columns: 64)."""
    c = model_config
    widths = {c["hidden_size"], c["intermediate_size"],
              c["num_attention_heads"] * (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])}
    g = group_size
    while g > 1 and any(w % g for w in widths):
        g //= 2
    return g


def _llmc_configs(model: str, group_size: int, peer_group: int | None, levels) -> list[Config]:
    """llm-compressor's GPTQ (tag ``llmc``) at ``levels``, each compared with ours at its group
    size: the default configuration, or one at ``peer_group`` (tag ``g64``) where the model's
    widths need it; and ours given its scales (tag ``llmc-scales``), compared with it."""
    pg = peer_group or group_size
    base = "" if pg == group_size else f"g{pg}"
    out = []
    for b in levels:
        if base:
            out.append(make_config(model, "GPTQ", b, base, method="gptq", bits=b, group_size=pg))
        out.append(make_config(model, "GPTQ", b, "llmc", base=base, method="gptq", bits=b, group_size=pg))
        out.append(make_config(model, "GPTQ", b, "llmc-scales", base="llmc", method="gptq", bits=b, group_size=pg))
    return out


def sweep_configs(model: str, group_size: int, peer_group: int | None = None) -> list[Config]:
    """Every configuration of the full study for ``model``: the Table-3 sweep and its variants."""
    out = [Config(model, "bf16", None)]
    for b in LEVELS:
        out.append(make_config(model, "RTN", b, method="rtn", bits=b, group_size=group_size))
        out.append(make_config(model, "GPTQ", b, method="gptq", bits=b, group_size=group_size))
        out.append(make_config(model, "HRTN", b, method="hrtn", target_bits=b + 0.125))
        out.append(make_config(model, "HPTQ", b, method="hptq", target_bits=b + 0.125))
        for rate, fam in ((0.01, "SSQR-1%"), (0.02, "SSQR-2%")):
            out.append(make_config(model, fam, b, method="ssqr", bits=b, group_size=group_size, outlier_rate=rate))
    # the output head quantized too (--quantize-lm-head, the CPU decode option): its perplexity cost
    out.append(make_config(model, "SSQR-1%", 4, "lm-head", method="ssqr", bits=4, group_size=group_size,
                           outlier_rate=0.01, quantize_lm_head=True))
    out.append(make_config(model, "SSQR-1%", 4, "lm-head8", method="ssqr", bits=4, group_size=group_size,
                           outlier_rate=0.01, quantize_lm_head=True, lm_head_bits=8))
    # the same 8-bit head on latq-quantize's default (GPTQ 4-bit g64), against it: the head's default
    out.append(make_config(model, "GPTQ", 4, "g64-lm-head8", base="g64", method="gptq", bits=4, group_size=64,
                           quantize_lm_head=True, lm_head_bits=8))
    # the ordering ablation: min-pivot instead of act-order (the pipeline's default) at 3 bits
    out.append(make_config(model, "GPTQ", 3, "min-pivot", method="gptq", bits=3, group_size=group_size,
                           order="min-pivot"))
    out.append(make_config(model, "SSQR-1%", 3, "min-pivot", method="ssqr", bits=3, group_size=group_size,
                           outlier_rate=0.01, order="min-pivot"))
    # the peer GPTQ at model level (the 4-bit one right after its default, see run_priority)
    for b in (4, 3):
        out.append(make_config(model, "GPTQ", b, "peer", method="gptq", bits=b, group_size=group_size))
    out += _llmc_configs(model, group_size, peer_group, (4, 3))
    # GPTQ at the other group sizes: the served-bits Pareto's baselines
    for g in GROUP_SIZES:
        for b in LEVELS:
            out.append(make_config(model, "GPTQ", b, f"g{g}", method="gptq", bits=b, group_size=g))
    # the target-correction lever at every level at the default group size, and at 4 bits (the
    # default's width) at the baselines' smaller groups; at 3 bits those points are already dominated
    # by coded scales, and a corrected run (one more forward per block) is slow
    for tag, g in TC_TAGS.items():
        for b in LEVELS if g == group_size else (4,):
            out.append(make_config(model, "GPTQ", b, tag, base="" if g == group_size else f"g{g}", method="gptq",
                                   bits=b, group_size=g, target_correction=True))
    # second-level scales at every level: a lever is measured at each width
    for tag, g in S4_TAGS.items():
        for b in LEVELS:
            twice = "" if 2 * g == group_size else f"g{2 * g}"   # the fp16-scaled group it is read against
            out.append(make_config(model, "GPTQ", b, tag, base=twice, method="gptq", bits=b, group_size=g,
                                   scale_bits=4))
    out += rotation_configs(model, group_size)
    out += e8_configs(model)
    # the noise floor at each level: other calibration draws
    for b in LEVELS:
        for s, tag in zip(NOISE_SEEDS, NOISE_TAGS):
            out.append(make_config(model, "GPTQ", b, tag, method="gptq", bits=b, group_size=group_size, seed=s))
    # its controls: how far perplexity moves when harmless changes flip a few integers (float
    # rounding; the damping moved by ±0.01 %; fp32 forwards): ours' own spread, against which a
    # peer gap is read
    for tag in SPREAD_TAGS:
        out.append(make_config(model, "GPTQ", 3, tag, method="gptq", bits=3, group_size=group_size,
                               **SPREAD_OPTS.get(tag, {})))
    return list(dict.fromkeys(out))   # SmolLM2's g64 baselines are both llm-compressor's and the Pareto's


def rotation_configs(model: str, group_size: int) -> list[Config]:
    """Every rotated configuration (:data:`ROT_TAGS`), each based on its unrotated one."""
    out, groups = [], {"": group_size, **{f"g{g}": g for g in GROUP_SIZES}, **S4_TAGS}
    for b in LEVELS:
        for base in ROT_GPTQ_BASES:
            g = groups[base]
            extra = {"scale_bits": 4} if base in S4_TAGS else {}
            out.append(make_config(model, "GPTQ", b, rot_tag(base), base=base, method="gptq", bits=b, group_size=g,
                                   rotate="hadamard", **extra))
        out.append(make_config(model, "SSQR-1%", b, "rot", method="ssqr", bits=b, group_size=group_size,
                               outlier_rate=0.01, rotate="hadamard"))
        if b >= 3:
            out.append(make_config(model, "HPTQ", b, "rot", method="hptq", target_bits=b + 0.125, rotate="hadamard"))
    out.append(make_config(model, "GPTQ", 3, ROT_TC_TAG, base="s4-g16", method="gptq", bits=3, group_size=16,
                           scale_bits=4, target_correction=True, rotate="hadamard"))
    return out


def e8_configs(model: str) -> list[Config]:
    """The E8 rows (:data:`E8_TAGS`): 4-bit coded scales at group size 16 at every level, the other
    variants at 3 bits; each against rotated GPTQ with the same scales (and, target-corrected, the
    target-corrected one: :data:`ROT_TC_TAG`)."""
    out = []
    for b in LEVELS:
        for tag, g in E8_TAGS.items():
            if tag != "rot-s4-g16" and b != 3:
                continue
            seed = next((int(t.removeprefix("seed")) for t in NOISE_TAGS if tag.endswith(t)), None)
            extra = {"seed": seed} if seed is not None else {}
            base = "rot-s4-g16" if g == 16 else "rot"
            if "-tc-" in tag:   # against rotated GPTQ with target correction too: one lever apart, not two
                extra["target_correction"] = True
                base = ROT_TC_TAG
            out.append(make_config(model, E8_FAMILY, b, tag, base=base, method="e8", bits=b,
                                   group_size=g, scale_bits=4, rotate="hadamard", **extra))
    return out


def tiny_configs(model: str, group_size: int, peer_group: int | None = None) -> list[Config]:
    """The CI study's configurations for ``model`` (``--tiny``)."""
    return [Config(model, "bf16", None),
            make_config(model, "GPTQ", 3, method="gptq", bits=3, group_size=group_size),
            make_config(model, "SSQR-1%", 3, method="ssqr", bits=3, group_size=group_size, outlier_rate=0.01),
            make_config(model, "GPTQ", 3, "min-pivot", method="gptq", bits=3, group_size=group_size,
                        order="min-pivot"),
            make_config(model, "GPTQ", 3, "peer", method="gptq", bits=3, group_size=group_size),
            *_llmc_configs(model, group_size, peer_group, (3,))]


def run_priority(cfg: Config, models) -> tuple:
    """Run order, so that an unfinished study already answers the paper's main questions:
    bf16 and the calibration-free baselines (seconds), then 3-bit (HPTQ vs GPTQ), 4-bit
    (SSQR near-lossless) and its quantized-head variant, 2-bit, then the ordering ablation;
    models alternate in each round."""
    if cfg.family == "bf16" or cfg.family in ("RTN", "HRTN"):
        rnd = 0
    elif cfg.tag in HEAD_TAGS or (cfg.tag in PEER_TAGS and cfg.level == 4):
        rnd = 2.5    # right after its 4-bit default
    elif cfg.tag:
        rnd = 4
    else:
        rnd = {3: 1, 4: 2, 2: 3}[cfg.level]
    return rnd, list(models).index(cfg.model)
