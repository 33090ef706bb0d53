"""Block inputs: block 0's hidden states and every block's keyword arguments, captured from the
model's own forward (blocks replaced by catchers); and running one block on them."""
from __future__ import annotations

import logging

import torch

from .. import hf_model
from ..progress import bar, step
from .activations import Activations
from .ranks import SINGLE, World
from .resume import RunDir

log = logging.getLogger("vllm_latq.quantize")


class _Stop(Exception):
    pass


class _Catcher(torch.nn.Module):
    """Stands in for decoder block ``i`` during capture: records its inputs and kwargs, passes them on."""

    def __init__(self, layer, i: int, store: dict, stop: bool):
        super().__init__()
        self.layer, self.i, self.store, self.stop = layer, i, store, stop

    def __getattr__(self, name):  # models may read attributes of their blocks (attention_type, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, hidden_states, *args, **kwargs):
        if args:  # (GPTBigCode passes the mask positionally): replayed by keyword
            kwargs = {**_by_keyword(self._modules["layer"], hidden_states, args), **kwargs}
        self.store["hidden"].setdefault(self.i, hidden_states)
        kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
        self.store["kwargs"].setdefault(self.i, kw)
        if self.stop:
            raise _Stop
        return hidden_states


def _by_keyword(layer, hidden_states, args) -> dict:
    """The block's positional arguments after the hidden states, by their parameter names."""
    import inspect
    try:
        bound = inspect.signature(layer.forward).bind_partial(hidden_states, *args)
    except TypeError as e:
        raise hf_model.UnsupportedModelError(f"{type(layer).__name__}: called with positional arguments its forward "
                                             f"does not name ({e})") from None
    names = list(bound.arguments)
    if any(inspect.signature(layer.forward).parameters[n].kind is inspect.Parameter.VAR_POSITIONAL for n in names):
        raise hf_model.UnsupportedModelError(f"{type(layer).__name__}: blocks take *args; cannot replay them by name")
    return {n: bound.arguments[n] for n in names[1:]}


@torch.no_grad()
def capture(model, layers: torch.nn.ModuleList, ids: torch.Tensor, all_kwargs: bool):
    """Run the model's forward on ``ids`` [1, seqlen] with catchers → (block 0's input, {block: kwargs})."""
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


@torch.no_grad()
def capture_inputs(model, layers: torch.nn.ModuleList, calib: torch.Tensor, acts: Activations,
                   progress: bool) -> dict:
    """Write block 0's inputs for every calibration sequence into ``acts`` → every block's kwargs."""
    kwargs = None
    with step("capturing block-0 inputs", progress, bar=False):   # a log's one line; a terminal's bar below
        for j in bar(range(len(calib)), "capturing block-0 inputs", progress, unit="seq"):
            h, kw = capture(model, layers, calib[j:j + 1].to(acts.device), all_kwargs=(j == 0))
            acts.write(j, h[0])
            kwargs = kwargs or kw
    acts.advance()
    return kwargs


@torch.no_grad()
def block_inputs(net: torch.nn.Module, layers: torch.nn.ModuleList, hidden_size: int, dtype: torch.dtype,
                 calib: torch.Tensor | None, run: RunDir, device, max_memory: int | None, progress: bool,
                 rows: range | None = None, world: World = SINGLE) -> tuple[Activations | None, dict | None]:
    """→ (the inputs of the first block ``run`` has not done, every block's kwargs); (None, None) uncalibrated.
    ``rows``: the sequences of ``calib`` this rank forwards."""
    if calib is None:  # an uncalibrated method: no forwards, the embeddings are not read
        return None, None
    for m in net.modules():  # the real buffers (rotary frequencies, ...) go to the device
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = b.to(device)
    shape = (len(calib), calib.shape[1], hidden_size)
    rows = range(len(calib)) if rows is None else rows
    mine = calib[rows.start:rows.stop]
    if run.blocks_done == 0:
        acts = Activations.create(run.path, shape, dtype, device, max_memory, rows=rows, world=world)
        kwargs = capture_inputs(net, layers, mine, acts, progress)
    else:
        kwargs = capture(net, layers, mine[:1].to(device), all_kwargs=True)[1]
        acts = Activations.resume(run.path, shape, dtype, device, max_memory, run.blocks_done, rows, world)
        log.info("resuming after block %d of %d", run.blocks_done - 1, len(layers))
    hf_model.to_meta(net)  # embeddings are not needed any more
    if len(kwargs) != len(layers):
        raise hf_model.UnsupportedModelError(f"captured the arguments of {len(kwargs)} of {len(layers)} decoder blocks")
    return acts, kwargs


def run_block(layer, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    y = layer(x, **kwargs)
    return y[0] if isinstance(y, (tuple, list)) else y


@torch.no_grad()
def block_outputs(layer, acts: Activations, kw: dict, desc: str, progress: bool) -> None:
    """Run the block on every calibration sequence: its outputs become the inputs ``acts`` holds."""
    for j in bar(range(len(acts)), f"{desc}: outputs", progress, unit="seq"):
        acts.write(j, run_block(layer, acts[j:j + 1], kw)[0])
    acts.advance()
