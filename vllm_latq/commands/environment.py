"""Every ``LATQ_*`` switch parsed before a command's work: a bad one is one line, exit 2 (docs/ENVIRONMENT.md)."""
from __future__ import annotations

import sys

from .. import env


def check_environment() -> None:
    """Parse every switch; a bad one raises :class:`~vllm_latq.env.EnvError`."""
    from ..data import paths
    from ..format import manifest, swap_hook
    from ..kernels import selector
    from ..quantize import faults, ranks

    reads = (manifest.no_verify_requested, manifest.expected_digest_from_env, selector.check_environment,
             ranks.dist_timeout, lambda: faults.stop_after(None), faults.fault_spec, faults.stage_fault,
             lambda: env.directory(paths.CACHE_ENV), lambda: env.existing_directory(swap_hook.SWAP_ENV))
    for read in reads:
        read()


def bad_environment(prog: str) -> bool:
    """Whether :func:`check_environment` refused a switch (its line printed, ``PROG: error: …``)."""
    try:
        check_environment()
    except env.EnvError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return True
    return False
