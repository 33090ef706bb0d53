"""Kernel selection: the kernels in order of preference (``kernels()``), and :func:`select`, which
picks the first whose ``can_implement`` accepts a layer and says why the others did not.
``LATQ_KERNEL=<name>`` forces one (docs/KERNELS.md, "Which kernel"); a rotated layer gets the
chosen kernel wrapped to rotate its inputs (``<kernel>+hadamard``).
"""
from __future__ import annotations

import logging

import torch

from .. import env
from .base import LatqKernel
from .dequantized import DequantizedBf16Kernel, DequantizedFp32Kernel
from .weight import RuntimeWeight
from .reference import ReferenceKernel
from .rotated import RotatedKernel, for_weight, rotated_kernel

ENV_FORCE = "LATQ_KERNEL"
RETIRED = {"dense": DequantizedBf16Kernel.name}   # LATQ_KERNEL values no longer accepted → the kernel now named


def kernels() -> list[type[LatqKernel]]:
    """All kernels, fastest first. Optional ones (they import Triton / torch's CPU op
    wrappers) are listed when importable."""
    found: list[type[LatqKernel]] = []
    try:
        from .vllm_mp import VllmMPKernel
        found.append(VllmMPKernel)
    except ImportError:
        pass
    try:
        from .triton.kernel import TritonKernel
        found.append(TritonKernel)
        from .triton.codebook import TritonCodebookKernel
        found.append(TritonCodebookKernel)
    except ImportError:
        pass
    try:
        from .cpu.kernel import CPUKernel
        found.append(CPUKernel)
    except ImportError:
        pass
    try:
        from .cpu.codebook import CPUCodebookA8Kernel, CPUCodebookKernel
        found += [CPUCodebookKernel, CPUCodebookA8Kernel]
    except ImportError:
        pass
    return found + [DequantizedBf16Kernel, ReferenceKernel, DequantizedFp32Kernel]


def kernel_index(kernel: type[LatqKernel]) -> int:
    """A kernel's number in :func:`kernels` (a rotated one's: past them), for flattened states."""
    found = kernels()
    if issubclass(kernel, RotatedKernel):
        return len(found) + found.index(kernel.inner)
    return found.index(kernel)


def kernel_at(index: int) -> type[LatqKernel]:
    """Inverse of :func:`kernel_index`."""
    found = kernels()
    return found[index] if index < len(found) else rotated_kernel(found[index - len(found)])


def family_name(k: type[LatqKernel]) -> str:
    """The family ``k`` belongs to: its ``family``, else its name."""
    return k.family or k.name


def forced_kernel() -> str | None:
    """The kernel name ``LATQ_KERNEL`` forces (one of :func:`kernels`' names, or a family's: its kernel
    for each runtime form), or None."""
    forced = env.value(ENV_FORCE)
    names = list(dict.fromkeys(n for k in kernels() for n in (k.name, family_name(k))))
    if forced in RETIRED:
        raise env.EnvError(ENV_FORCE, forced, f"one of {', '.join(names)}, or unset: {ENV_FORCE}={forced!r} is no "
                                              f"longer a kernel name: {ENV_FORCE}={RETIRED[forced]} is that kernel "
                                              "(\"dense\" names a checkpoint layer's kind only)")
    return env.choice(ENV_FORCE, names)


def check_environment() -> None:
    """Every switch the kernels read, parsed: a bad value refused before a layer is built."""
    from .. import cpu_features, native
    forced = forced_kernel()   # imports every kernel there is, parsing their module-level switches
    members = [k for k in kernels() if forced in (k.name, family_name(k))]
    why = [k.unavailable_here() for k in members]
    if members and all(why):   # a name this install has, which cannot run here: refused now, not at a layer
        raise env.EnvError(ENV_FORCE, forced, f"a kernel that runs on this machine ({forced} {why[0]}), or unset")
    cpu_features.forced_bf16()
    native.enabled(), native.loop_max(), native.march(), native.check_library_switches()
    try:
        from .cpu import dequant as cpu_dequant, kernel as cpu_kernel
        cpu_dequant.chunk_bytes(), cpu_dequant.prefill_cache()
        cpu_kernel.split_max_extra_rate(), cpu_kernel.forced_large_m()
    except ImportError:   # the kernel is not here: its switches are never read
        pass
    try:
        from .triton import configs as triton_configs, kernel as triton_kernel
        triton_configs.autotune_enabled(), triton_configs.checked_override_path(), triton_kernel.interpret_ok()
    except ImportError:
        pass


# latq's compressed kernel families, by the device type each serves (in the order reports list them)
FAMILY_OF_DEVICE = {"cpu": "cpu", "cuda": "triton"}


def families() -> list[type[LatqKernel]]:
    """latq's compressed kernel families importable here, in :data:`FAMILY_OF_DEVICE`'s order."""
    found = {k.name: k for k in kernels()}
    return [found[name] for name in FAMILY_OF_DEVICE.values() if name in found]


def family_member(family: str, form: type) -> type[LatqKernel] | None:
    """Family ``family``'s kernel for runtime form ``form``, or None (it has none here)."""
    return next((k for k in kernels() if family_name(k) == family and form in k.forms), None)


def family_for(device: torch.device) -> type[LatqKernel] | None:
    """The compressed kernel family that serves layers on ``device`` (``LATQ_KERNEL`` when it
    forces one): its ``widths`` and ``layout_bytes`` choose an HPTQ layer's inlier width at
    load (:func:`~vllm_latq.kernels.transcode.transcode`). None: none is available here (the
    runtime form's own bytes choose)."""
    name = forced_kernel() or FAMILY_OF_DEVICE.get(torch.device(device).type)
    for k in kernels():
        if k.name == name and "layout_bytes" in vars(k):
            return k
    return None


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        logging.getLogger("vllm.latq").warning(msg)   # under vLLM's log config


def in_preference(found: list[type[LatqKernel]], device: torch.device) -> list[type[LatqKernel]]:
    """``found`` in the order asked on ``device``: on CPU the kernels marked ``cpu_opt_in``
    come right after latq's own CPU kernel."""
    if torch.device(device).type != "cpu":
        return found
    late = [k for k in found if getattr(k, "cpu_opt_in", False)]
    rest = [k for k in found if k not in late]
    at = next((i + 1 for i, k in enumerate(rest) if k.name == FAMILY_OF_DEVICE["cpu"]), 0)
    return rest[:at] + late + rest[at:]


def select(w: RuntimeWeight, device: torch.device, act_dtype: torch.dtype,
           skip: tuple[str, ...] = ()) -> type[LatqKernel]:
    return select_with_reasons(w, device, act_dtype, skip)[0]


def select_with_reasons(w: RuntimeWeight, device: torch.device, act_dtype: torch.dtype,
                        skip: tuple[str, ...] = ()) -> tuple[type[LatqKernel], list[str]]:
    """The kernel :func:`select` picks — never one named in ``skip`` — and why each kernel
    asked before it refused."""
    forced = forced_kernel()
    reasons = []
    for k in in_preference([k for k in kernels() if k.name not in skip], device):
        if forced and forced not in (k.name, family_name(k)):
            continue
        if type(w) not in k.forms:
            if forced or k.family is None:   # a family's member for other forms says nothing here
                reasons.append(f"{k.name}: serves {' and '.join(f.__name__ for f in k.forms)} layers, not "
                               f"{type(w).__name__}")
            continue
        if not forced and (not k.auto_select or (getattr(k, "cpu_opt_in", False)
                                                 and torch.device(device).type == "cpu")):
            reasons.append(f"{k.name}: opt-in only{' on CPU' if k.auto_select else ''} ({ENV_FORCE}={k.name})")
            continue
        ok, why = k.can_implement(w, device, act_dtype)
        if ok:
            if k is DequantizedBf16Kernel and not forced:
                _warn_once(f"latq: no compressed kernel runs {w.out_features}x{w.in_features} {w.bits}-bit layers "
                           f"on {device} ({'; '.join(reasons)}): they run dequantized to bf16 (kernel '{k.name}')")
            return for_weight(k, w), reasons
        reasons.append(f"{k.name}: {why}")
    raise ValueError(f"{f'{ENV_FORCE}={forced}: ' if forced else ''}no latq kernel can run this layer "
                     f"({w.out_features}x{w.in_features}, "
                     f"{w.bits}-bit, device {device}, {act_dtype}): " + "; ".join(reasons))
