"""``--load-format latq``: the weights read by latq in each vLLM worker from files it opened once and verified
there, against the digest checked at config time and a pinned one (docs/FORMAT.md, "Manifest")."""
from __future__ import annotations

import time
from typing import Iterator

import torch
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..errors import FormatError
from ..format.checkpoint import Checkpoint, checkpoint_dir
from ..format.files import MANIFEST_FILE
from ..format.manifest import expected_digest_from_env, no_verify_requested, verify_manifest
from ..format.swap_hook import swap_if_asked
from .config import DIGEST_KEY, LatqCheckpointRefused


class LatqModelLoader(DefaultModelLoader):
    """vLLM's default loader, its weights read by :func:`verified_weights`."""

    def download_model(self, model_config) -> None:
        checkpoint_dir(model_config.model, model_config.revision)   # latq downloads nothing

    def get_all_weights(self, model_config, model) -> Iterator[tuple[str, torch.Tensor]]:
        if getattr(model, "secondary_weights", ()):
            raise LatqCheckpointRefused(f"latq: --load-format latq reads one latq checkpoint; {type(model).__name__} "
                                        "also loads weights from other sources: use vLLM's loader")
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        qc = getattr(model_config.hf_config, "quantization_config", None)
        validated = qc.get(DIGEST_KEY) if isinstance(qc, dict) else None
        yield from verified_weights(model_config.model, model_config.revision, validated)


def open_verified(path, validated: str | None) -> Checkpoint:
    """Checkpoint ``path`` opened; its manifest checked against ``validated`` and the pin, its files against it."""
    ck = Checkpoint(path, expected_digest_from_env())
    if not no_verify_requested():
        if validated is not None and ck.digest != validated:
            raise FormatError(f"the checkpoint's digest is {ck.digest}, not {validated}, the one checked when vLLM "
                              "built its config: it was replaced after that check", file=MANIFEST_FILE)
        verify_manifest(ck.files, ck.config, ck.shards, None, ck.manifest)
        ck.checked = True
    return ck


def verified_weights(model: str, revision: str | None, validated: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of checkpoint ``model``, each hashed as read; a refusal is one line naming the file."""
    try:
        path = checkpoint_dir(model, revision)
        ck = open_verified(path, validated)
    except FormatError as e:
        raise LatqCheckpointRefused(f"latq: {model} refused: {e}") from None
    swap_if_asked(path)
    try:
        for shard in sorted(ck.shards):
            for name in ck.shards[shard].names():
                try:
                    t = ck.tensor(name)
                except FormatError as e:
                    raise LatqCheckpointRefused(f"latq: {model} refused: {e}") from None
                yield name, t
    finally:
        ck.files.close()
