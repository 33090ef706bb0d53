"""The run directory ``OUT.tmp-latq`` and what lets an interrupted run continue (the same command again).

A resume needs the same fingerprint and every checksum to hold; a tampered or corrupted partial
state is refused, never sealed."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..bounded_io import file_sha256, read_json
from ..errors import FormatError
from ..format import output_dir, safetensors_file
from ..format import writer
from ..format.manifest import json_sha256
from .. import format as fmt
from . import activations, ranks
from .activations import Activations, inputs_file
from ..format.files import TEMP_MARK
from .output import COMMAND, TMP_SUFFIX, exclusive, run_dir_of  # noqa: F401  (TMP_SUFFIX: a public name)
from .ranks import SINGLE, World

log = logging.getLogger("vllm_latq.quantize")

PROGRESS_FILE = "latq_progress.json"
# a rerun without --resume continues a partial run of the same fingerprint too: only --overwrite starts over
START_OVER = "rerun with --overwrite (without --resume) to start over"
# part of the resume fingerprint (3: RTN/HRTN run uncalibrated; 4: bf16 forwards; 5: activations saved per block;
# 6: the source and the calibration text by their bytes' sha256)
PIPELINE_VERSION = 6


def fingerprint(src: Path, options: dict, files: list[str], config: dict, texts: dict[str, Path] | None = None) -> str:
    """What must not change before a ``--resume``: the bytes of ``files`` and ``texts``, the config, the options."""
    digests = {f: file_sha256(src / f, name=str(src / f)) for f in sorted(files)}
    text_digests = {k: file_sha256(p, name=str(p)) for k, p in sorted((texts or {}).items())}
    blob = json.dumps({"pipeline": PIPELINE_VERSION, "format": fmt.FORMAT_VERSION, "options": options,
                       "files": digests, "texts": text_digests, "config": config}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class RunDir:
    """The run directory of output ``out`` and the state it resumes from."""
    path: Path
    fingerprint: str
    blocks_done: int = 0
    stats: list = field(default_factory=list)   # per-layer records of the blocks done
    world: World = SINGLE
    shards: dict = field(default_factory=dict)  # {finished shard: sha256 of the file as written}
    sealed: Path | None = None   # the checkpoint is complete, sealed by a killed run: in ``path`` or already in OUT
    claim: output_dir.Claim | None = None   # OUT held (rank 0)

    @classmethod
    def open(cls, claim: output_dir.Claim, fp: str, resume: bool, *, overwrite: bool = False,
             nblocks: int | None = None) -> "RunDir":
        """The held OUT's run directory: taken whole if a killed run sealed it; resumed if a run of the same
        fingerprint left finished blocks (asked with ``resume`` or not) and they verify; a partial run of another
        fingerprint, or one that does not verify, refused unless ``overwrite`` (without ``resume``) discards it."""
        tmp = claim.tmp
        for where in (tmp, claim.out):
            if claim.noted(where, fp):
                log.info("%s holds the checkpoint an interrupted run of this command sealed: %s, not computed again",
                         where, "kept" if where == claim.out else f"moved to {claim.out}")
                return cls(tmp, fp, sealed=where, claim=claim)
        state = None
        leftover = any(e.name != TEMP_MARK for e in os.scandir(tmp))
        discard = overwrite and not resume   # --overwrite starts over where the partial run cannot be continued
        if leftover:
            try:
                state = _progress(tmp)
                if state is not None and state.get("fingerprint") != fp:
                    done = state.get("blocks_done")
                    done = f" ({done} block{'' if done == 1 else 's'} finished)" if isinstance(done, int) else ""
                    raise ValueError(f"{tmp} holds an interrupted run of another source or other options{done}: "
                                     "rerun that command (--resume or not) to continue it, or pass --overwrite "
                                     "without --resume to discard it")
                if state is not None:
                    verify_partial_state(tmp, state)
            except ValueError as e:   # FormatError too
                if not discard:
                    raise
                log.warning("discarding the partial run %s (--overwrite): %s", tmp, e)
                state = None
            else:
                if state is None:   # stopped before its first block was saved: no finished work in it
                    log.warning("removing %s, left by an interrupted run before it finished a block", tmp)
                else:
                    log.warning("resuming %d%s finished blocks from %s (same source and options)",
                                state["blocks_done"], "" if nblocks is None else f" of {nblocks}", tmp.name)
        elif resume:
            log.info("nothing to resume at %s: starting from block 0", tmp)
        if state is None:
            output_dir.make_temporary(tmp, COMMAND)   # emptied in place: the lock is on the directory
            claim.forget_journal()
            return cls(tmp, fp, claim=claim)
        for part in tmp.rglob("*.part"):   # a write the interruption cut short
            part.unlink()
        claim.forget_journal()
        return cls(tmp, fp, state["blocks_done"], state["stats"], shards=state["shards"], claim=claim)

    @classmethod
    def attach(cls, out: Path, fp: str, world: World) -> "RunDir":
        """The run directory rank 0 has just opened, seen from another rank."""
        tmp = run_dir_of(out)
        state = _progress(tmp)
        if state is not None and state.get("fingerprint") != fp:
            raise ValueError(f"{tmp}: rank {world.rank} computes another fingerprint than rank 0 (a different "
                             "source or options on this node)")
        if state is None:
            return cls(tmp, fp, world=world)
        return cls(tmp, fp, state["blocks_done"], state["stats"], world, state["shards"])

    def save_block(self, i: int, shard_name: str, shard: dict, *streams: Activations | None) -> None:
        """Persist block ``i``: its shard, the next block's inputs (``streams``), the progress record."""
        streams = [s for s in streams if s is not None]
        if self.world.writes:
            self.shards[shard_name] = safetensors_file.write_safetensors(self.path / shard_name, shard)
        for s in streams:
            if s.block != i + 1:
                raise RuntimeError(f"block {i} is saved with the inputs of block {s.block} ({s.run_dir})")
            s.save()   # every rank's rows: they meet there
        self.blocks_done = i + 1
        if self.world.writes:
            saved = [inputs_file(s.run_dir, s.block) for s in streams]
            record = {"fingerprint": self.fingerprint, "blocks_done": i + 1, "stats": self.stats, "shards": self.shards,
                      "activations": {f.relative_to(self.path).as_posix(): file_sha256(f) for f in saved}}
            writer.write_json(self.path / PROGRESS_FILE, {**record, "sha256": json_sha256(record)})
        ranks.barrier(self.world)   # no rank reads the older inputs any more
        for s in streams:
            s.remove_older()

    def clear_progress(self) -> None:
        """The run is complete: drop what only a resume needs."""
        activations.remove_all(self.path)
        (self.path / PROGRESS_FILE).unlink()
        for part in self.path.glob("*.part"):
            part.unlink()


def _progress(tmp: Path) -> dict | None:
    """The progress record of ``tmp``, or None before the first block; an unreadable one is refused."""
    try:
        state = read_json(tmp / PROGRESS_FILE, name=str(tmp / PROGRESS_FILE))
    except FileNotFoundError:
        return None
    if not isinstance(state, dict):
        raise FormatError(f"not a progress record: {START_OVER}", file=str(tmp / PROGRESS_FILE))
    return state


def verify_partial_state(tmp: Path, state: dict) -> None:
    """Refuse, naming the file, a progress record, shard or activation file that differs from its checksum."""
    where = str(tmp / PROGRESS_FILE)
    rest = {k: v for k, v in state.items() if k != "sha256"}
    if state.get("sha256") != json_sha256(rest):
        raise FormatError("its checksum does not match its content (edited or corrupted, or written by an older "
                          f"latq): {START_OVER}", file=where)
    shards, acts = state.get("shards"), state.get("activations")
    ok = (isinstance(state.get("blocks_done"), int) and isinstance(state.get("stats"), list)
          and isinstance(shards, dict) and len(shards) == state["blocks_done"] and isinstance(acts, dict))
    if not ok:
        raise FormatError("does not record blocks_done, stats, one checksum per finished shard and the saved "
                          f"activations: {START_OVER}", file=where)
    for name, digest in sorted({**shards, **acts}.items()):
        path = tmp / name
        if not path.resolve().is_relative_to(tmp.resolve()):
            raise FormatError(f"names a file outside the run directory: {START_OVER}", file=where)
        try:
            same = file_sha256(path, name=str(path)) == digest
        except FileNotFoundError:
            raise FormatError(f"missing, but recorded as finished: {START_OVER}", file=str(path)) from None
        if not same:
            raise FormatError("differs from what the interrupted run wrote (its sha256 in latq_progress.json): "
                              f"corrupted or edited; {START_OVER}", file=str(path))


@contextmanager
def held_output(out: Path, source: Path, overwrite: bool, world: World = SINGLE):
    """OUT held by rank 0 for the body (:func:`.output.exclusive`) → its claim (None elsewhere), refusals agreed."""
    if not world.writes:
        ranks.agree_or_raise(None, "locking the output directory", world)
        yield None
        return
    with ExitStack() as held:
        error = claim = None
        try:
            claim = held.enter_context(exclusive(out, source, overwrite))
        except Exception as e:   # noqa: BLE001  (every rank raises it)
            error = e
        ranks.agree_or_raise(error, "locking the output directory", world)
        yield claim


@contextmanager
def run_directory(claim: output_dir.Claim | None, out: Path, fp: str, resume: bool, world: World = SINGLE, *,
                  overwrite: bool = False, nblocks: int | None = None):
    """:meth:`RunDir.open` in the held OUT's run directory for the run; a run that saved no block leaves nothing."""
    if not world.writes:
        ranks.agree_or_raise(None, "opening the run directory", world)
        run = RunDir.attach(out, fp, world)
        run.sealed = ranks.share({}, {"sealed": 0}, world)["sealed"]
        yield run
        return
    error = run = None
    try:
        run = RunDir.open(claim, fp, resume, overwrite=overwrite, nblocks=nblocks)
        run.world = world
    except Exception as e:   # noqa: BLE001  (every rank raises it)
        error = e
    ranks.agree_or_raise(error, "opening the run directory", world)
    ranks.share({"sealed": run.sealed}, {"sealed": 0}, world)
    try:
        yield run
    except BaseException:
        if run.sealed is None and run.blocks_done == 0 and run.path.exists():
            output_dir.clear_temporary(run.path, COMMAND)   # made for this run: the lock removes it, now empty
        raise
