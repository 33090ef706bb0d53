"""Writing a hand-quantized checkpoint as the pipeline writes one (checksums, stats, manifest), so it
passes the validator every reader runs."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import format as fmt
from ..format.files import STATS_FILE
from ..format.manifest import write_manifest
from ..format.safetensors_file import write_safetensors
from ..format.validate import validate_checkpoint
from ..format.writer import write_json


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict, shapes: dict[str, tuple[int, int]],
                     source: str = "test") -> Path:
    """Write ``tensors`` (one shard), ``config``, stats and manifest into ``out``, then validate it."""
    from ..quantize.finalize import stats_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    qc = config["quantization_config"]
    kind = fmt.kind_of(qc["method"])
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        s = fmt.split_name(name)
        if s is not None:
            layers.setdefault(s[0], {})[s[1]] = t
    stats = [{"name": m, "method": qc["method"], "shape": list(shapes[m]),
              **fmt.layer_stats(t, kind, shapes[m]), "rel_error": None, "cert": None}
             for m, t in sorted(layers.items())]
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_json(out / STATS_FILE, stats_file(stats, qc["method"], Path(source), qc.get("group_size"),
                                            qc["format_version"]))
    write_manifest(out)
    validate_checkpoint(out, decode=False)
    return out
