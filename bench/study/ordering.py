"""The ordering study (paper Table 2): tr(D) of the damped Hessian's LDL per column order on real
Hessians of a few decoder blocks, with the layer-level peer GPTQ comparisons on the same layers."""
from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

from vllm_latq import data
from vllm_latq.algorithms.lattice import ORDERS as PACKAGE_ORDERS

from .configs import peer_group_size
from .runner import Settings, read_cached, source_dir, write_json
from bench.study.peers import llmc_compare, peer_compare

log = logging.getLogger("latq.study")

LAYER_TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the package's column orders plus a random one, in the report's (paper Table 2's) column order
_COLUMNS = ("natural", "reverse", "random", "act", "min-pivot")
ORDERS = tuple(sorted((*PACKAGE_ORDERS, "random"),
                      key=lambda o: _COLUMNS.index(o) if o in _COLUMNS else len(_COLUMNS)))


def block_hessians(model_name: str, mdir: Path, blocks, nsamples: int, seqlen: int):
    """{(block, linear name): (W, H)} of the bf16 model on Wikipedia calibration text; the
    forward stops after the last requested block."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_latq.quantize.hessian import linear_hessians
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
    layers = model.model.layers
    mods = {(b, n): m for b in blocks for n, m in layers[b].named_modules() if isinstance(m, torch.nn.Linear)}
    batches = data.calibration_batches(tok, nsamples=nsamples, seqlen=seqlen)
    return linear_hessians(model, mods, batches, stop_after=layers[max(blocks)],
                           desc=f"{model_name}: Hessians of blocks {list(blocks)}")


def ordering_study(model: str, st: Settings, root: Path, compute: bool = True) -> dict | None:
    """tr(D) per order and the layer-level peer GPTQ, or the cached result (``compute=False``:
    the cached result or None)."""
    from tqdm.auto import tqdm

    from vllm_latq.algorithms import ldl_diag
    mdir = source_dir(model, st, root)
    nblocks = json.loads((mdir / "config.json").read_text())["num_hidden_layers"]
    blocks = tuple(st.ordering_blocks) or (nblocks // 4, nblocks // 2, (3 * nblocks) // 4)
    path = root / "results" / model / "ordering.json"
    key = st.ordering_key(blocks)
    r = read_cached(path, key, f"{model} ordering study")
    if r is not None:
        return r
    if not compute:
        return None
    log.info("running: %s ordering study on blocks %s", model, list(blocks))
    t0 = time.time()
    layers = block_hessians(model, mdir, blocks, st.ordering_nsamples, st.seqlen)
    rows = []
    for (b, name), (W, H) in tqdm(layers.items(), desc=f"{model}: tr(D) per order + peer GPTQ", unit="layer"):
        tr = {o: ldl_diag(H, o).sum().item() for o in ORDERS if o != "random"}
        rnd = []
        for s in range(st.ordering_seeds):
            g = torch.Generator().manual_seed(s)
            rnd.append(ldl_diag(H, torch.randperm(H.shape[0], generator=g)).sum().item())
        tr["random"] = statistics.fmean(rnd)
        peer = {str(bits): peer_compare(W, H, bits, st.group_size) for bits in st.peer_bits}
        rows.append({"block": b, "name": name, "type": name.split(".")[-1], "trD": tr, "peer": peer})
    gs = peer_group_size(json.loads((mdir / "config.json").read_text()), st.group_size)
    for bits in st.peer_bits:   # llm-compressor, at the group size it accepts
        lc = llmc_compare({f"{b}.{n}": wh for (b, n), wh in layers.items()}, bits, gs)
        for row in rows:
            row.setdefault("llmc", {})[str(bits)] = {**lc[f"{row['block']}.{row['name']}"], "group_size": gs}
    r = {"model": model, "blocks": list(blocks), "rows": rows, "seconds": round(time.time() - t0, 1),
         "settings": key}
    write_json(path, r)
    return r
