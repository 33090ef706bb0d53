"""Where the data lives: the cache root and the folders of installed data packages."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .. import env

CACHE_ENV = "LATQ_CACHE"


def cache_dir() -> Path:
    """Root of the vllm_latq cache: ``$LATQ_CACHE`` or ``~/.cache/vllm_latq`` (created)."""
    root = Path(env.directory(CACHE_ENV) or Path.home() / ".cache" / "vllm_latq")
    root.mkdir(parents=True, exist_ok=True)
    return root


def package_dir(module: str, install_hint: str) -> Path:
    """Folder of an installed package, found without importing it (imports have side effects)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module!r} is not installed: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])
