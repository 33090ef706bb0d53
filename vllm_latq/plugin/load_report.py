"""What one model load's latq layers were loaded as: a debug line per layer, then a summary and kernel table."""
from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

from ..kernels.weight import LatqWeight

logger = init_logger("vllm.latq")


@dataclass
class LayerRow:
    """One loaded layer."""
    weights: int           # out × in
    stored_bits: float     # per weight, the checkpoint's tensors
    served_bits: float     # per weight, what the chosen kernel streams per decode step
    bits: int              # inlier width
    nnz: int               # outliers
    kernel: str            # the chosen kernel's label
    codes_kept: bool       # coded scales kept in the runtime form
    head: bool = False     # the output head (a quantized lm_head)


class LoadReport:
    """The layers of one model load: logs the summary and kernel table once the last layer is in."""

    def __init__(self, method: str, scale_bits: int | None = None):
        self.method, self.scale_bits = method, scale_bits
        self.expected = 0
        self.layers: list[LayerRow] = []
        self.reasons: dict[tuple[str, tuple[str, ...]], int] = {}   # (kernel, refusals before it) → layers
        self.shared: set[tuple[str, int]] = set()   # (device, address) of tensors layers share, counted once

    def expect(self) -> None:
        self.expected += 1

    def add(self, prefix: str, w: LatqWeight, kernel, state, stored_bits: float,
            refused: list[str] = (), head: bool = False) -> None:   # head: the output head, whatever its name
        n = w.out_features * w.in_features
        label = kernel.label(state)
        served = kernel.served_bytes(state)
        for part, t in kernel.shared_tensors(state).items():   # streamed once a step, by the first layer
            key = (str(t.device), t.data_ptr())
            if key in self.shared:
                served[part] = 0
            self.shared.add(key)
        bpw = 8 * sum(served.values()) / n
        logger.debug("latq %s: %dx%d, %d-bit inliers, group %d, %.3f%% outliers, stored %.3f bits/weight, served "
                     "%.3f bits/weight (%s), kernel %s%s", prefix, w.out_features, w.in_features, w.bits,
                     w.group_size, 100 * w.nnz / n, stored_bits, bpw,
                     ", ".join(f"{k} {v} B" for k, v in served.items()), label,
                     "".join(f"; {r}" for r in refused))
        self.layers.append(LayerRow(n, stored_bits, bpw, w.bits, w.nnz, label, w.coded is not None, head))
        key = (label, tuple(refused))
        self.reasons[key] = self.reasons.get(key, 0) + 1
        if len(self.layers) == self.expected:
            logger.info("latq: %s", self.summary())
            logger.info("latq: kernel choices:\n%s", self.reason_table())

    def reason_table(self) -> str:
        """One line per (kernel chosen, why earlier kernels refused): layer count, served bits/weight."""
        lines = []
        for (label, refused), count in sorted(self.reasons.items(), key=lambda kv: -kv[1]):
            rows = [r for r in self.layers if r.kernel == label]
            lines.append(f"  {count:4d} layers → {label} ({_mean(rows, 'served_bits'):.3f} bits/weight served)"
                         + ("".join(f"; refused by {r}" for r in refused) if refused else ""))
        return "\n".join(lines)

    def served_bits(self) -> float:
        """Served bits/weight of the model's latq layers, each with its chosen kernel."""
        return _mean(self.layers, "served_bits")

    def summary(self) -> str:
        rows = self.layers
        total = sum(r.weights for r in rows)
        widths: dict = {}
        kernels: dict = {}
        for r in rows:
            widths[r.bits] = widths.get(r.bits, 0) + 1
            kernels[r.kernel] = kernels.get(r.kernel, 0) + 1
        codes = "" if self.scale_bits is None else (
            f", {self.scale_bits}-bit scale codes: kept in {sum(r.codes_kept for r in rows)} of {len(rows)} "
            "layers' runtime forms")
        head = next((r for r in rows if r.head), None)
        mb = sum(r.weights * r.served_bits for r in rows) / 8e6
        return (f"{len(rows)} linears loaded ({self.method} checkpoint{codes}): stored "
                f"{_mean(rows, 'stored_bits'):.3f} bits/weight, served "
                f"{self.served_bits():.3f} bits/weight with the kernel chosen per layer ({mb:.1f} MB a decode step, "
                + (f"the {head.bits}-bit output head's {head.weights * head.served_bits / 8e6:.1f} included"
                   if head else "the output head not a latq layer") + "), inlier widths "
                f"{dict(sorted(widths.items()))}, {100 * sum(r.nnz for r in rows) / total:.3f}% outliers, "
                f"kernels {kernels}")


def _mean(rows: list[LayerRow], field: str) -> float:
    """``field`` averaged over ``rows`` weighted by their weights."""
    return sum(r.weights * getattr(r, field) for r in rows) / sum(r.weights for r in rows)
