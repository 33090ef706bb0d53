"""The run directory ``OUT.tmp-latq`` and what lets an interrupted run continue.

Every finished block leaves its shard, the next block's inputs (``latq_activations.<block>.bin``,
:mod:`.activations`) and the progress record (blocks done, per-layer stats, the run's fingerprint) in the run
directory; ``--resume`` continues from there if the fingerprint — source files, config,
options, pipeline and format versions — is the same, and a run without ``--resume`` starts
over. The finished checkpoint is renamed into place only at the end (:mod:`.finalize`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..format import safetensors_file
from ..format import writer
from .. import format as fmt
from . import activations, ranks
from .activations import Activations
from .output import OWNER_FILE, exclusive, record_owner
from .ranks import SINGLE, World

log = logging.getLogger("vllm_latq.quantize")

TMP_SUFFIX = ".tmp-latq"
PROGRESS_FILE = "latq_progress.json"
# part of the resume fingerprint (3: RTN/HRTN run uncalibrated; 4: bf16 forwards; 5: activations saved per block)
PIPELINE_VERSION = 5


def fingerprint(src: Path, options: dict, files: list[str], config: dict) -> str:
    """What must not change between an interrupted run and its ``--resume``: the source
    (path, ``files`` and their sizes, ``config``) and the ``options`` that shape the output."""
    sizes = sorted((f, (src / f).stat().st_size) for f in files)
    blob = json.dumps({"pipeline": PIPELINE_VERSION, "format": fmt.FORMAT_VERSION, "options": options,
                       "source": str(src.resolve()), "files": sizes, "config": config}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class RunDir:
    """The run directory of output ``out`` and the state it resumes from."""
    path: Path
    fingerprint: str
    blocks_done: int = 0
    stats: list = field(default_factory=list)   # per-layer records of the blocks done
    world: World = SINGLE

    @classmethod
    def open(cls, out: Path, fp: str, resume: bool) -> "RunDir":
        """The run directory of ``out``, continued when ``resume`` and it holds an interrupted
        run with fingerprint ``fp``, else (re)created empty; a resume of a run with another
        fingerprint is refused."""
        tmp = out.with_name(out.name + TMP_SUFFIX)
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
        if state is None:
            return cls(tmp, fp)
        return cls(tmp, fp, state["blocks_done"], state["stats"])

    @classmethod
    def attach(cls, out: Path, fp: str, world: World) -> "RunDir":
        """The run directory rank 0 has just opened (:meth:`open`), seen from another rank."""
        tmp = out.with_name(out.name + TMP_SUFFIX)
        progress = tmp / PROGRESS_FILE
        state = json.loads(progress.read_text()) if progress.exists() else None
        if state is not None and state.get("fingerprint") != fp:
            raise ValueError(f"{tmp}: rank {world.rank} computes another fingerprint than rank 0 (a different "
                             "source or options on this node)")
        if state is None:
            return cls(tmp, fp, world=world)
        return cls(tmp, fp, state["blocks_done"], state["stats"], world)

    def save_block(self, i: int, shard_name: str, shard: dict, *streams: Activations | None) -> None:
        """Persist block ``i``: its shard, the next block's inputs in each of ``streams`` (the
        calibration activations; target correction's full-precision ones; None: an
        uncalibrated run has none), the progress record; then drop the inputs saved for block ``i``."""
        streams = [s for s in streams if s is not None]
        if self.world.writes:
            safetensors_file.write_safetensors(self.path / shard_name, shard)
        for s in streams:
            if s.block != i + 1:
                raise RuntimeError(f"block {i} is saved with the inputs of block {s.block} ({s.run_dir})")
            s.save()   # every rank's rows: they meet there
        self.blocks_done = i + 1
        if self.world.writes:
            writer.write_json(self.path / PROGRESS_FILE, {"fingerprint": self.fingerprint, "blocks_done": i + 1,
                                                        "stats": self.stats})
        ranks.barrier(self.world)   # no rank reads the older inputs any more
        for s in streams:
            s.remove_older()

    def clear_progress(self) -> None:
        """The run is complete: drop what only a resume needs."""
        activations.remove_all(self.path)
        (self.path / PROGRESS_FILE).unlink()
        (self.path / OWNER_FILE).unlink(missing_ok=True)


@contextmanager
def run_directory(out: Path, fp: str, resume: bool, world: World = SINGLE):
    """:meth:`RunDir.open` under ``out``'s lock, held until the body (the run) ends. A run that
    ends before its first block is saved leaves nothing behind: a resume could use none of it.
    With several ranks rank 0 opens and locks it; the others attach once it has."""
    if not world.writes:
        ranks.agree_or_raise(None, "opening the run directory", world)
        yield RunDir.attach(out, fp, world)
        return
    with ExitStack() as held:
        error = None
        try:
            held.enter_context(exclusive(out, out.with_name(out.name + TMP_SUFFIX)))
            run = RunDir.open(out, fp, resume)
            run.world = world
            record_owner(run.path)
        except Exception as e:   # noqa: BLE001  (every rank raises it)
            error = e
        ranks.agree_or_raise(error, "opening the run directory", world)
        try:
            yield run
        except BaseException:
            if run.blocks_done == 0 and run.path.exists():
                shutil.rmtree(run.path)
            raise
