"""The offline pipeline: a Hugging Face causal LM → a latq checkpoint, block by block.

Sequential calibration (the standard GPTQ pipeline): the inputs of decoder block 0 are
captured once; then for every block i

1. its weights are loaded from the source safetensors (only this block is in memory),
2. the Hessians ``XᵀX`` of all its linears are accumulated (fp64 sum of fp32 per-sequence
   products, :class:`BlockHessian`) over every calibration
   sequence (linears fed the same tensor — q/k/v, gate/up — share one Hessian),
3. every linear is quantized and its weight replaced by the dequantized result,
4. the block is run again: its outputs, computed by the *quantized* block, are the inputs of
   block i+1,
5. the block's shard is written (with the activations and progress, for ``--resume``).

RTN and HRTN ignore activations, so for them steps 2 and 4 (and the calibration data) are
skipped: they quantize at the speed of reading the weights.

The keyword arguments a block receives from the model (position embeddings, attention masks:
they differ per layer type in Gemma3) are captured from one real forward call per block, with
the blocks replaced by catchers, and replayed. Everything is deterministic: the same source,
options and seed give a byte-identical checkpoint, with or without an interruption, at the same
torch thread count (BLAS reductions, hence the last bits of activations, depend on it).

The calibration forwards run in the model's dtype (``compute_dtype``: bf16 for a bf16 model, as
GPTQ runs in its model's half precision; ~2× faster than fp32 on CPUs with bf16 instructions);
the solvers work in fp32 on the exact weights, the Hessians are summed in fp64.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import data
from .. import format as fmt
from .. import hf_model
from ..format import writer
from ..format.files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, STATS_FILE
from ..format.safetensors_file import SafetensorsFile, write_safetensors
from ..format.validate import validate_checkpoint
from .hessian import Hessian
from .lattice import layer_error

log = logging.getLogger("vllm_latq.quantize")

UNCALIBRATED = ("rtn", "hrtn")  # solvers that ignore H
STOP_ENV = "LATQ_STOP_AFTER_BLOCK"  # testing: raise SimulatedInterruption after this block
TMP_SUFFIX = ".tmp-latq"
PROGRESS_FILE = "latq_progress.json"
ACTS_FILE = "latq_activations.safetensors"
PIPELINE_VERSION = 4  # part of the resume fingerprint (3: RTN/HRTN run uncalibrated; 4: bf16 forwards)
COMPUTE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


class SimulatedInterruption(RuntimeError):
    """Raised after block k when ``stop_after_block=k`` (or ``$LATQ_STOP_AFTER_BLOCK=k``)."""


@dataclass
class QuantizeOptions:
    method: str = "ssqr"
    bits: int = 4
    group_size: int = 128
    outlier_rate: float = 0.01
    target_bits: float = 3.125
    order: str = "act"
    damp: float = 0.01
    calib: str = "wiki"
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    device: str = "cpu"
    # dtype of the calibration forwards: "auto" = the source model's (bf16 for a bf16 model, the
    # dtype GPTQ implementations run in; bf16 GEMMs are ~3x fp32 ones on CPUs with AVX512-BF16),
    # fp32 for fp16/fp32 sources. Weights are solved in fp32 and Hessians summed in fp64 either way.
    compute_dtype: str = "auto"
    # also quantize the output head (lm_head) with the same method; a tied head is untied:
    # the embedding stays in the model dtype, the quantized head is written as ``lm_head.*``
    quantize_lm_head: bool = False
    # with quantize_lm_head, a dense method: the head's inlier bits (e.g. 8: its error is then
    # negligible while it streams half the bf16 bytes); None: ``bits`` like every other layer
    lm_head_bits: int | None = None

    def __post_init__(self):
        fmt.kind_of(self.method)  # FormatError for an unknown method
        if self.order not in ("act", "min-pivot", "natural"):
            raise ValueError(f"order must be act, min-pivot or natural, got {self.order!r}")
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be in 2..8, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group size must be positive, got {self.group_size}")
        if not 0 <= self.outlier_rate < 1:
            raise ValueError(f"outlier rate must be in [0, 1), got {self.outlier_rate}")
        if self.target_bits <= 1:
            raise ValueError(f"target bits must exceed 1, got {self.target_bits}")
        if self.damp < 0:
            raise ValueError(f"damp must be >= 0, got {self.damp}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype must be one of {sorted(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if self.lm_head_bits is not None:
            if not self.quantize_lm_head:
                raise ValueError("lm_head_bits needs quantize_lm_head (the head is otherwise kept unquantized)")
            if self.kind != "dense":
                raise ValueError(f"lm_head_bits is for the dense methods (ssqr/gptq/rtn/babai), not {self.method}")
            if not 2 <= self.lm_head_bits <= 8:
                raise ValueError(f"lm_head_bits must be in 2..8, got {self.lm_head_bits}")

    @property
    def kind(self) -> str:
        return fmt.kind_of(self.method)

    @property
    def calibrated(self) -> bool:
        """RTN and HRTN never look at activations: their pipeline runs no calibration forwards."""
        return self.method not in UNCALIBRATED

    def torch_compute_dtype(self, source_config: dict) -> torch.dtype:
        """The calibration forwards' dtype for a source with config.json ``source_config``."""
        if self.compute_dtype != "auto":
            return COMPUTE_DTYPES[self.compute_dtype]
        return torch.bfloat16 if hf_model.model_dtype(source_config) == "bfloat16" else torch.float32

    def solver_kwargs(self) -> dict:
        m = self.method
        if m == "ssqr":
            return dict(bits=self.bits, group_size=self.group_size, outlier_rate=self.outlier_rate,
                        order=self.order, damp=self.damp)
        if m == "hptq":
            return dict(target_bits=self.target_bits, order=self.order, damp=self.damp)
        if m == "hrtn":
            return dict(target_bits=self.target_bits)
        if m == "rtn":
            return dict(bits=self.bits, group_size=self.group_size)
        # gptq and babai: the clipped baselines (babai = clipped Babai ≡ GPTQ in reversed order)
        return dict(bits=self.bits, group_size=self.group_size, order=self.order, damp=self.damp, clip=True)

    def quantization_config(self, modules_not_converted, head_name: str | None = None) -> dict:
        return fmt.quantization_config(
            self.method, bits=self.bits, group_size=self.group_size, outlier_rate=self.outlier_rate,
            target_bits=self.target_bits, order=self.order, damp=self.damp,
            modules_not_converted=modules_not_converted,
            layer_bits={head_name: self.lm_head_bits} if head_name and self.lm_head_bits else None,
            calibration={"source": _source_label(self.calib), "nsamples": self.nsamples,
                         "seqlen": self.seqlen, "seed": self.seed} if self.calibrated else None,
            **({"lm_head_quantized": True} if self.quantize_lm_head else {}))

    def head_options(self) -> "QuantizeOptions":
        """The options the output head is quantized with (``lm_head_bits`` as its ``bits``)."""
        return self if self.lm_head_bits is None else dataclasses.replace(self, bits=self.lm_head_bits)


def _source_label(calib: str) -> str:
    return "wiki" if str(calib) == "wiki" else Path(calib).name


def solve(method: str, W: torch.Tensor, H: torch.Tensor, name: str, **kw):
    """Run one solver (a name from ``format.METHODS``) → QuantResult with CPU tensors."""
    from . import babai, gptq, hptq, hrtn, rtn, ssqr
    fn = {"ssqr": ssqr, "hptq": hptq, "gptq": gptq, "rtn": rtn, "hrtn": hrtn, "babai": babai}[method]
    res = fn(W, H, name=name, **kw)
    for f in ("z", "q", "scales", "order", "bound"):
        v = getattr(res, f)
        if isinstance(v, torch.Tensor):
            setattr(res, f, v.cpu())
    if res.outliers is not None:
        o = res.outliers
        o.crow, o.col, o.val = o.crow.cpu(), o.col.cpu(), o.val.cpu()
    return res


# ============================================================================ the source model

def resolve_model(spec: str | os.PathLike) -> Path:
    """An HF model directory for ``spec``: a directory with config.json, a ``.gguf`` file
    (converted once into ``cache_dir()/converted``), or a name from ``data.MODELS``."""
    s = str(spec)
    if s in data.MODELS:
        return data.model_dir(s)
    p = Path(s).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        st = p.resolve().stat()
        key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
        out = data.cache_dir() / "converted" / f"{p.stem}-{key}"
        if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
            return out
        from filelock import FileLock
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not ((out / "config.json").is_file() and any(out.glob("*.safetensors"))):
                log.info("converting %s to a Hugging Face directory in %s (once)", p, out)
                data.convert_gguf(p, out)
        return out
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json: not a Hugging Face model directory")
        return p
    raise FileNotFoundError(f"model {s!r}: not a Hugging Face model directory, a .gguf file, or one of "
                            f"{sorted(data.MODELS)}")


class SourceWeights:
    """Tensors of a safetensors HF directory, read one at a time (memory-mapped)."""

    def __init__(self, d: Path):
        from safetensors import safe_open
        idx = d / INDEX_FILE
        if idx.is_file():
            files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        elif (d / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise FileNotFoundError(f"{d}: no safetensors weights (only safetensors sources are supported; "
                                    "convert .bin checkpoints with transformers first)")
        self.handles = {f: safe_open(str(d / f), framework="pt") for f in files}
        self.where = {k: f for f, h in self.handles.items() for k in h.keys()}

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self.handles[self.where[name]].get_tensor(name)


# ============================================================================ block inputs

class _Stop(Exception):
    pass


class _Catcher(torch.nn.Module):
    """Stands in for decoder block ``i`` during the capture pass: records its inputs and
    keyword arguments, returns the hidden states unchanged (or stops the forward)."""

    def __init__(self, layer, i: int, store: dict, stop: bool):
        super().__init__()
        self.layer, self.i, self.store, self.stop = layer, i, store, stop

    def __getattr__(self, name):  # models may read attributes of their blocks (attention_type, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise hf_model.UnsupportedModelError("decoder blocks called with extra positional arguments")
        self.store["hidden"].setdefault(self.i, hidden_states)
        kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
        self.store["kwargs"].setdefault(self.i, kw)
        if self.stop:
            raise _Stop
        return hidden_states


@torch.no_grad()
def capture(model, layers: torch.nn.ModuleList, ids: torch.Tensor, all_kwargs: bool):
    """Run the model's own forward on ``ids`` [1, seqlen] with the blocks replaced by
    catchers → (input of block 0, {block: kwargs}); ``all_kwargs=False`` stops at block 0."""
    store = {"hidden": {}, "kwargs": {}}
    n = len(layers)
    orig = list(layers)
    for i in range(n):
        layers[i] = _Catcher(orig[i], i, store, stop=(i == n - 1) or not all_kwargs)
    try:
        model.base_model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for i in range(n):
            layers[i] = orig[i]
    if 0 not in store["hidden"]:
        raise hf_model.UnsupportedModelError(f"{type(model).__name__}: the forward pass never reached decoder block 0")
    return store["hidden"][0], store["kwargs"]


def run_block(layer, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    y = layer(x, **kwargs)
    return y[0] if isinstance(y, (tuple, list)) else y


def block_outputs(layer, inps: torch.Tensor, kw: dict, desc: str, progress: bool) -> torch.Tensor:
    """The block's outputs for every calibration sequence, one sequence per call."""
    from tqdm.auto import tqdm
    outs = torch.empty_like(inps)
    for j in tqdm(range(len(inps)), desc=f"{desc}: outputs", unit="seq", disable=not progress, leave=False):
        outs[j] = run_block(layer, inps[j:j + 1], kw)[0]
    return outs


# ============================================================================ Hessians

PRODUCT_ROWS = 512  # rows per fp32 XᵀX product; products are summed in fp64
PANEL = 512  # columns per block row of the upper-triangular product


class BlockHessian(Hessian):
    """``XᵀX / n`` with an fp64 accumulator, each product of ≤ ``PRODUCT_ROWS`` rows (one
    calibration sequence) computed by an fp32 GEMM and added to the fp64 sum. A 512-term fp32
    dot product is accurate to ~1e-7 relative (measured on Gemma3's real activations: max
    entry error 1.3e-7 of the largest entry), far below the 1 % damping, while fp64 GEMMs cost
    ~2× fp32 ones on CPUs — and more than the block's forward pass itself. The sum over
    sequences, where fp32 would lose the small eigenvalues, is fp64.

    Only the block rows of the upper triangle are computed and summed (``PANEL`` columns
    each): for a 2048-wide input that halves both the GEMM and the fp64 additions, which
    together cost as much as the block's bf16 forward. :attr:`H` mirrors the upper triangle."""

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.sum.device)
        n = x.shape[1]
        for part in x.split(PRODUCT_ROWS):
            part = part.float()
            for c in range(0, n, PANEL):
                self.sum[c:c + PANEL, c:].add_(part[:, c:c + PANEL].T @ part[:, c:])
        self.n += x.shape[0]

    @property
    def H(self) -> torch.Tensor:
        upper = super().H.triu()
        return upper + upper.triu(1).T


class SharedHessians:
    """Forward pre-hooks on a block's linears accumulating ``XᵀX`` in fp64. During the first
    forward, linears that receive the very same input tensor (q/k/v, gate/up) are grouped and
    share one Hessian; afterwards only each group's first member accumulates."""

    def __init__(self, linears: dict[str, torch.nn.Linear]):
        self.linears = linears
        self.of: dict[str, Hessian] = {}
        self.leader: dict[str, bool] = {}
        self._call: list = []  # (input tensor, Hessian) seen in the current forward (keeps refs)
        self.frozen = False
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in linears.items()]

    def _hook(self, name):
        def hook(mod, args):
            x = args[0]
            if self.frozen:
                if self.leader[name]:
                    self.of[name].add(x.detach())
                return
            for seen, hs in self._call:
                if seen is x:  # the very same tensor object (kept alive in _call: ids cannot be reused)
                    self.of[name], self.leader[name] = hs, False
                    return
            hs = BlockHessian(mod.in_features, mod.weight.device)
            hs.add(x.detach())
            self.of[name], self.leader[name] = hs, True
            self._call.append((x, hs))
        return hook

    def end_forward(self):
        if not self.frozen:
            missing = set(self.linears) - set(self.of)
            if missing:
                raise RuntimeError(f"linears never called in a forward pass: {sorted(missing)}")
            self.frozen = True
            self._call = []

    def groups(self) -> list[list[str]]:
        out: dict[int, list[str]] = {}
        for n in self.linears:
            out.setdefault(id(self.of[n]), []).append(n)
        return list(out.values())

    def remove(self):
        for h in self.handles:
            h.remove()


def block_hessians(layer, linears: dict, inps: torch.Tensor, kw: dict, desc: str, progress: bool) -> SharedHessians:
    """Run the (unquantized) block on every calibration sequence with Hessian hooks."""
    from tqdm.auto import tqdm
    hs = SharedHessians(linears)
    try:
        for j in tqdm(range(len(inps)), desc=f"{desc}: Hessians", unit="seq", disable=not progress, leave=False):
            run_block(layer, inps[j:j + 1], kw)
            hs.end_forward()
    finally:
        hs.remove()
    return hs


# ============================================================================ the pipeline

def _fingerprint(src: Path, opts: QuantizeOptions, sources: SourceWeights, config: dict) -> str:
    """What must not change between an interrupted run and its ``--resume``."""
    files = sorted((f, (src / f).stat().st_size) for f in sources.handles)
    # quantize_lm_head=False / lm_head_bits=None are left out: runs interrupted before the options
    # existed resume
    blob = json.dumps({"pipeline": PIPELINE_VERSION, "format": fmt.FORMAT_VERSION,
                       "options": {k: v for k, v in dataclasses.asdict(opts).items()
                                   if k != "device" and not (k in ("quantize_lm_head", "lm_head_bits") and not v)},
                       "source": str(src.resolve()), "files": files, "config": config}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _layer_stats(name, W, H, res, t, kind) -> dict:
    """Per-layer record for latq_stats.json (deterministic: no timings). Without a Hessian
    (uncalibrated methods) there is no output error to report: ``rel_error`` is None."""
    rel = None
    if H is not None:
        num = layer_error(W, res.q, H).sum().item()
        den = layer_error(W, torch.zeros_like(W), H).sum().item()
        rel = num / den if den > 0 else 0.0
    cert = None
    if res.bound is not None:
        err = res.error(W, H)
        cert = (err / res.bound.clamp_min(1e-300)).max().item()
    st = fmt.layer_stats(t, kind, tuple(W.shape))
    return {"name": name, "method": res.method, "shape": list(W.shape), "bits": st["bits"],
            "solver_bits": float(res.bits_per_weight), "outlier_rate": st["outlier_rate"],
            "rel_error": rel, "cert": cert,
            "damp": res.damp, "alpha": res.info.get("alpha")}


def _log_line(s: dict) -> str:
    cert = f"{s['cert']:.3f}" if s["cert"] is not None else "—"
    rel = f"{s['rel_error']:.3e}" if s["rel_error"] is not None else "—"
    return (f"{s['name']}: {s['method']} {s['bits']:.3f} bits/w, outliers {100 * s['outlier_rate']:.3f}%, "
            f"rel.err {rel}, cert {cert}")


def quantize_model(model: str | os.PathLike, out: str | os.PathLike, opts: QuantizeOptions | None = None, *,
                   resume: bool = False, overwrite: bool = False, progress: bool = True,
                   on_layer: Callable | None = None, stop_after_block: int | None = None,
                   validate: bool = True) -> Path:
    """Quantize ``model`` (see :func:`resolve_model`) into the checkpoint directory ``out``.

    ``on_layer(name, W, H, result)`` is called for every quantized linear (tests).
    ``stop_after_block=k`` raises :class:`SimulatedInterruption` once block k is persisted
    (default: ``$LATQ_STOP_AFTER_BLOCK``), to test ``resume``. Returns ``out``."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    opts = opts or QuantizeOptions()
    if stop_after_block is None and os.environ.get(STOP_ENV):
        stop_after_block = int(os.environ[STOP_ENV])
    t_start = time.time()
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    src = resolve_model(model)
    raw_cfg = hf_model.config_dict(src)
    if "quantization_config" in raw_cfg:
        qm = raw_cfg["quantization_config"].get("quant_method", "?") if isinstance(raw_cfg["quantization_config"],
                                                                                dict) else "?"
        raise ValueError(f"{src} is already quantized (quant_method {qm!r}); start from a bf16/fp16/fp32 model")
    config = hf_model.hf_config(raw_cfg)
    hf_model.check_supported(config)
    sources = SourceWeights(src)
    device = torch.device(opts.device)

    cdtype = opts.torch_compute_dtype(raw_cfg)
    net = hf_model.empty_model(config, cdtype)
    prefix, layers = hf_model.decoder_layers(net)
    nblocks = len(layers)
    expected = dict(net.state_dict())
    head = net.get_output_embeddings()
    head_names = {n for n, m in net.named_modules() if m is head}
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [n for n in expected
               if n not in sources.where and not (tied and n.rpartition(".")[0] in head_names)
               and n in dict(net.named_parameters())]
    if missing:
        raise ValueError(f"{src}: tensors of the model are missing from its safetensors files: {missing[:4]}")
    block_of = {}  # source tensor name -> block index
    for n in sources.names():
        if n.startswith(prefix + "."):
            block_of[n] = int(n[len(prefix) + 1:].split(".")[0])
    ignored = sorted(n for n in sources.names() if n not in expected)
    if ignored:
        log.warning("ignoring %d source tensors the model does not use: %s", len(ignored), ignored[:4])

    # quantized = every linear inside a decoder block; the rest keeps its dtype
    qlinears = {}
    for i, layer in enumerate(layers):
        qlinears[i] = list(hf_model.block_linears(layer, f"{prefix}.{i}"))
    quantized = {n for names in qlinears.values() for n in names}
    head_name = None
    if opts.quantize_lm_head:
        head_name, head_src, norm_name = _head_plan(net, head, tied, sources)
        quantized.add(head_name)
    not_converted = sorted(n for n, m in net.named_modules()
                           if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and n not in quantized)

    # ---------------------------------------------------------------- temp dir and resume state
    tmp = out.with_name(out.name + TMP_SUFFIX)
    fp = _fingerprint(src, opts, sources, raw_cfg)
    state = None
    if tmp.exists():
        try:
            state = json.loads((tmp / PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            state = None
        if resume and state is not None and state.get("fingerprint") != fp:
            raise ValueError(f"{tmp} holds an interrupted run of a different model or options; remove it or "
                             "rerun without --resume")
        if not resume or state is None:
            log.warning("removing stale partial output %s", tmp)
            shutil.rmtree(tmp)
            state = None
    elif resume:
        log.info("nothing to resume at %s: starting from block 0", tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    start = state["blocks_done"] if state else 0
    stats: list[dict] = state["stats"] if state else []
    nshards = nblocks + 1

    calibrated = opts.calibrated
    if not calibrated and str(opts.calib) != "wiki":
        log.warning("%s uses no calibration data: ignoring --calib %s", opts.method, opts.calib)
    if calibrated:
        tok = AutoTokenizer.from_pretrained(src)
        calib = data.calibration_batches(tok, nsamples=opts.nsamples, seqlen=opts.seqlen, seed=opts.seed,
                                         source=opts.calib)

    # ---------------------------------------------------------------- block-0 inputs, per-block kwargs
    outside = [n for n in expected if n not in block_of and not n.rpartition(".")[0] in head_names
               and n in dict(net.named_parameters())]
    for n in outside:
        hf_model.set_tensor(net, n, sources.get(n).to(device=device, dtype=cdtype))
    for m in net.modules():  # the real buffers (rotary frequencies, ...) go to the device
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = b.to(device)
    inps = kwargs = None
    with torch.no_grad():
        if calibrated and start == 0:
            inps = torch.empty(len(calib), opts.seqlen, config.hidden_size, dtype=cdtype, device=device)
            kwargs = None
            for j in tqdm(range(len(calib)), desc="capturing block-0 inputs", unit="seq", disable=not progress,
                          leave=False):
                h, kw = capture(net, layers, calib[j:j + 1].to(device), all_kwargs=(j == 0))
                inps[j] = h[0]
                kwargs = kwargs or kw
        elif calibrated:
            _, kwargs = capture(net, layers, calib[:1].to(device), all_kwargs=True)
            acts = SafetensorsFile(tmp / ACTS_FILE)
            if acts.metadata.get("blocks_done") != str(start):
                raise ValueError(f"{tmp / ACTS_FILE} does not match {PROGRESS_FILE}; rerun without --resume")
            inps = acts.get("hidden").to(device)
            log.info("resuming after block %d of %d", start - 1, nblocks)
    hf_model.to_meta(net)  # embeddings are not needed any more
    if calibrated and len(kwargs) != nblocks:
        raise hf_model.UnsupportedModelError(f"captured the arguments of {len(kwargs)} of {nblocks} decoder blocks")

    # ---------------------------------------------------------------- blocks
    bar = tqdm(range(start, nblocks), desc=f"{opts.method} blocks", unit="block", disable=not progress,
               initial=start, total=nblocks)
    for i in bar:
        layer = layers[i]
        bprefix = f"{prefix}.{i}."
        names = [n for n in sources.names() if block_of.get(n) == i]
        for n in names:
            hf_model.set_tensor(net, n, sources.get(n).to(device=device, dtype=cdtype))
        linears = hf_model.block_linears(layer, f"{prefix}.{i}")
        t0 = time.time()
        with torch.no_grad():
            if calibrated:
                kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs[i].items()}
                hs = block_hessians(layer, linears, inps, kw, f"block {i}", progress)
            t1 = time.time()
            shard: dict[str, torch.Tensor] = {}
            for name in tqdm(linears, desc=f"block {i}: quantizing", unit="layer", disable=not progress,
                             leave=False):
                # from the source: exact even when the forwards run in a narrower dtype than it
                W = sources.get(f"{name}.weight").to(device=device, dtype=torch.float32)
                res, t = _quantize_linear(name, W, hs.of[name] if calibrated else None, opts, stats, on_layer)
                shard.update(t)
                hf_model.set_tensor(net, f"{name}.weight", res.q.to(device=device, dtype=cdtype))
            hs = None
            t2 = time.time()
            if calibrated:
                inps = block_outputs(layer, inps, kw, f"block {i}", progress)
            log.info("block %d/%d: Hessians %.1fs, quantization %.1fs, outputs %.1fs", i, nblocks, t1 - t0,
                     t2 - t1, time.time() - t2)
        for n in names:  # the rest of the block in its original dtype and name
            if n.rpartition(".")[0] in linears and n.endswith(".weight"):
                continue
            shard[n] = sources.get(n)
        write_safetensors(tmp / writer.shard_name(i, nshards), shard)
        hf_model.to_meta(layer)
        if calibrated:
            write_safetensors(tmp / ACTS_FILE, {"hidden": inps}, {"blocks_done": str(i + 1)})
        writer.write_json(tmp / PROGRESS_FILE, {"fingerprint": fp, "blocks_done": i + 1, "stats": stats})
        if stop_after_block is not None and i == stop_after_block:
            raise SimulatedInterruption(f"simulated interruption after block {i}")
    bar.close()
    head_tensors = {}
    if head_name is not None:
        head_tensors = _quantize_head(net, inps, sources, head_name, head_src, norm_name, opts, stats,
                                      on_layer, device, progress)
    del inps

    # ---------------------------------------------------------------- the rest, metadata, rename
    rest = {n: sources.get(n) for n in sources.names() if n not in block_of and n in expected
            and not (head_name is not None and n == f"{head_name}.weight")}
    rest.update(head_tensors)
    write_safetensors(tmp / writer.shard_name(nblocks, nshards), rest)
    shards = [writer.shard_name(i, nshards) for i in range(nshards)]
    writer.write_index(tmp, shards)
    cfg = dict(raw_cfg)
    cfg["quantization_config"] = opts.quantization_config(not_converted, head_name)
    if calibrated:
        cfg["quantization_config"]["calibration"]["compute_dtype"] = str(cdtype).removeprefix("torch.")
    if head_name is not None and tied:
        cfg["tie_word_embeddings"] = False   # the embedding stays, the head is stored quantized
    writer.write_json(tmp / CONFIG_FILE, cfg)
    writer.copy_aux_files(src, tmp)
    writer.write_json(tmp / STATS_FILE, _stats_file(stats, opts, src))
    (tmp / ACTS_FILE).unlink(missing_ok=True)
    (tmp / PROGRESS_FILE).unlink()
    if validate:
        validate_checkpoint(tmp, decode=True, verify_checksums=False)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    tot = _stats_file(stats, opts, src)["totals"]
    log.info("wrote %s: %d layers, %.4f bits/weight, outliers %.3f%%, in %.0fs", out, tot["layers"],
             tot["bits_per_weight"], 100 * tot["outlier_rate"], time.time() - t_start)
    return out


def _quantize_linear(name: str, W: torch.Tensor, hs: Hessian, opts: QuantizeOptions, stats: list,
                     on_layer) -> tuple:
    """Solve one linear on its accumulated Hessian, log and record its stats → (result, its
    checkpoint tensors named ``<name>.<suffix>``)."""
    H = hs.H if hs is not None else None
    res = solve(opts.method, W, H, name, **opts.solver_kwargs())
    t = fmt.encode_layer(res, opts.kind)
    s = _layer_stats(name, W.cpu(), H.cpu() if H is not None else None, res, t, opts.kind)
    s["hessian_tokens"] = hs.n if hs is not None else 0
    stats.append(s)
    log.info(_log_line(s))
    if on_layer is not None:
        on_layer(name, W, H, res)
    return res, {f"{name}.{sfx}": v for sfx, v in t.items()}


def _head_plan(net, head, tied: bool, sources: SourceWeights) -> tuple[str, str, str]:
    """For ``--quantize-lm-head``: (head module name, source tensor holding its weight — the
    embedding when tied —, final norm module name)."""
    names = {m: n for n, m in net.named_modules()}
    if not isinstance(head, torch.nn.Linear) or head not in names:
        raise hf_model.UnsupportedModelError(f"{type(net).__name__}: the output head is not an nn.Linear; "
                                         "cannot quantize it")
    if head.bias is not None:
        raise hf_model.UnsupportedModelError(
            f"{type(net).__name__}: quantizing an lm_head with a bias is not supported")
    head_name = names[head]
    src = f"{head_name}.weight"
    if tied:
        emb = net.get_input_embeddings()
        src = f"{names[emb]}.weight"
    if src not in sources.where:
        raise ValueError(f"the head's weight {src} is not in the source safetensors")
    norm = getattr(net.base_model, "norm", None)
    if not isinstance(norm, torch.nn.Module) or norm not in names:
        raise hf_model.UnsupportedModelError(f"{type(net).__name__}: no final norm at {type(net.base_model).__name__}"
                                         ".norm: cannot compute the lm_head's input activations")
    return head_name, src, names[norm]


def _quantize_head(net, inps: torch.Tensor, sources: SourceWeights, head_name: str, head_src: str,
                   norm_name: str, opts: QuantizeOptions, stats: list, on_layer, device, progress) -> dict:
    """Quantize the output head like a block linear: its Hessian is ``XᵀX/n`` of its real inputs,
    the final norm applied to the last (quantized) block's outputs over all calibration
    tokens — the same sequential protocol as the blocks. Returns the head's tensors."""
    from tqdm.auto import tqdm

    norm = net.get_submodule(norm_name)
    dtype = inps.dtype if inps is not None else torch.float32  # the calibration forwards' dtype
    for n, p in list(norm.named_parameters()):
        hf_model.set_tensor(norm, n, sources.get(f"{norm_name}.{n}").to(device=device, dtype=dtype))
    W = sources.get(head_src).to(device=device, dtype=torch.float32)
    t0 = time.time()
    with torch.no_grad():
        hs = None
        if inps is not None:  # None: an uncalibrated method
            hs = BlockHessian(W.shape[1], device)
            for j in tqdm(range(len(inps)), desc=f"{head_name}: Hessian", unit="seq", disable=not progress,
                          leave=False):
                hs.add(norm(inps[j:j + 1]))
        _, t = _quantize_linear(head_name, W, hs, opts.head_options(), stats, on_layer)
    log.info("%s (weight from %s, Hessian from %s outputs): %.1fs", head_name, head_src, norm_name, time.time() - t0)
    hf_model.to_meta(norm)
    return t


def _stats_file(stats: list[dict], opts: QuantizeOptions, src: Path) -> dict:
    n = sum(s["shape"][0] * s["shape"][1] for s in stats)
    wavg = lambda k: sum(s[k] * s["shape"][0] * s["shape"][1] for s in stats) / n if n else 0.0  # noqa: E731
    certs = [s["cert"] for s in stats if s["cert"] is not None]
    rels = [s["rel_error"] for s in stats if s["rel_error"] is not None]
    return {"format_version": fmt.FORMAT_VERSION, "method": opts.method, "source": src.name,
            "layers": stats,
            "totals": {"layers": len(stats), "quantized_params": n, "bits_per_weight": wavg("bits"),
                       "outlier_rate": wavg("outlier_rate"), "rel_error_mean": sum(rels) / len(rels)
                       if rels else None, "cert_max": max(certs) if certs else None}}
