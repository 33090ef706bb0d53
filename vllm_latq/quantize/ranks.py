"""The ranks of a ``torchrun`` quantization run: every collective the pipeline needs, and where
ranks split and meet. Without torchrun, :func:`init` returns :data:`SINGLE`: the identity."""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .. import env
from ..errors import limits
from ..threads import fit_to_idle_cores

log = logging.getLogger("vllm_latq.quantize")

TIMEOUT_ENV = "LATQ_DIST_TIMEOUT"  # seconds a collective waits for a silent rank (default 300)
LAUNCHER_POLL_S = 1.0              # how often a rank looks whether its launcher still lives


def dist_timeout() -> float:
    """Seconds a collective waits for a silent rank (``LATQ_DIST_TIMEOUT``, default 300)."""
    return env.number(TIMEOUT_ENV, 300.0, minimum=0.0, above=True, maximum=1e7)


class RankFailed(RuntimeError):
    """A rank failed; raised on every rank, naming the first failed rank and where."""


class RanksDisagree(ValueError):
    """The ranks were given different commands: raised on every rank, said by rank 0 alone."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def writes(self) -> bool:
        """Rank 0 alone writes the checkpoint, the progress record and the log's per-layer lines."""
        return self.rank == 0


SINGLE = World()


def launched_ranks() -> int:
    """How many ranks torchrun launched (``WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(device: str = "cpu") -> World:
    """Join the process group torchrun describes in the environment, or :data:`SINGLE`."""
    if launched_ranks() <= 1:
        return SINGLE
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=dist_timeout())
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return World(dist.get_rank(), dist.get_world_size(), local)


@contextmanager
def joined(device: str, command: dict):
    """This process's :class:`World` for the body, every rank checked to run the same ``command``."""
    stop_with_launcher()
    world = init(device)
    try:
        check_same_command(command, world)
        if not world.distributed:   # ranks keep the threads torchrun gave them
            fit_to_idle_cores("quantizing")
        announce(world)
        yield world
    except Exception as e:
        lost = lost_rank(e) if world.distributed else None
        if lost is not None:
            raise lost from e
        raise
    finally:
        shutdown(world)


_launcher = [0]                 # the pid of this rank's launcher while a watch runs
_stopping = threading.Lock()


def stop_with_launcher() -> None:
    """Under torchrun, end this rank when its launcher dies: a killed agent neither stops nor
    collects its ranks, which would run on to the end unseen. Ending is as abrupt as a kill,
    which a run survives (the finished blocks are kept); a node's local rank 0 says so."""
    parent = os.getppid()
    if launched_ranks() <= 1 or parent == 1:
        return
    _launcher[0] = parent
    if threading.current_thread() is threading.main_thread():   # where Python runs signal handlers
        signal.signal(signal.SIGTERM, _stopped_by_launcher)

    def watch():
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        stop_if_launcher_gone()
    threading.Thread(target=watch, name="latq-launcher-watch", daemon=True).start()


def _stopped_by_launcher(signum, frame) -> None:
    """SIGTERM from torchrun's agent (sent to every rank when one ends): raised where this rank is."""
    if sys.exc_info()[0] is None:   # a rank already unwinding an error lets it finish
        raise RankFailed(f"this rank was stopped by its launcher during {_step[0]}: another rank stopped answering "
                         "(it died or was killed: see its log), or the launcher was stopped")


def stop_if_launcher_gone() -> None:
    """End this rank if its launcher is gone. A peer's watch may fire first and break a collective
    here: the launcher, not that peer, is the cause to name, and it is named once."""
    parent = _launcher[0]
    if not parent or os.getppid() == parent:
        return
    with _stopping:   # the watch and a failed collective may both arrive; os._exit ends the process inside
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"latq-quantize: the ranks' launcher (torchrun's agent, pid {parent}) is gone: every rank of this "
                  "node stops; the finished blocks are kept: rerun with --resume", file=sys.stderr, flush=True)
        os._exit(1)


def shutdown(world: World) -> None:
    if world.distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_rank(code: int):
    """End a torchrun rank without interpreter teardown: gloo threads still freeing tensors abort it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def announce(world: World) -> list[int]:
    """Log on rank 0 the ranks × torch threads per rank."""
    threads = [torch.get_num_threads()] * world.size
    if world.distributed:
        torch.distributed.all_gather_object(threads, torch.get_num_threads())
    plural = "s" * (threads[0] != 1)
    if world.writes and not world.distributed:
        log.info("1 rank × %d thread%s", threads[0], plural)
    elif world.writes:
        each = f"{threads[0]} thread{plural} each" if len(set(threads)) == 1 else \
            f"threads {', '.join(map(str, threads))}"
        log.info("%d ranks (%s) × %s", world.size, torch.distributed.get_backend(), each)
    return threads


def own_rows(n: int, world: World, per_product: int = 1) -> range:
    """This rank's contiguous share of ``n`` sequences: whole products of ``per_product`` sequences."""
    products = -(-n // per_product)
    first, last = (r * products // world.size for r in (world.rank, world.rank + 1))
    return range(min(n, first * per_product), min(n, last * per_product))


def sum_hessian(h, world: World, name: str) -> None:
    """Hessian ``h`` made the sum over every rank's rows: the exact pairs merged on rank 0, rounded
    once (one process's bits); a sum the pair could not hold exactly is said in the log."""
    pair = h.pair()
    if world.distributed:
        _merge_on_rank0(pair, world)
        lost = pair.inexact.to(_collective_device(), torch.int32)
        torch.distributed.all_reduce(lost, op=torch.distributed.ReduceOp.MAX)
        pair.inexact.fill_(bool(lost))
        h.sum = pair.rounded() if world.writes else pair.hi
        torch.distributed.broadcast(h.sum, src=0)
        h.n = sum_counts([h.n], world)[0]
    if not pair.exact and world.writes:
        log.warning("%s: the Hessian's sum was not held exactly (its products span too many binary orders); "
                    "its last bits, and a rare integer with them, may differ at another rank count", name)


def _merge_on_rank0(pair, world: World) -> None:
    """Every rank's exact pair added to rank 0's (in any order: the sums are exact)."""
    lo = [pair.lo_of(k) for k in range(len(pair.regions))]
    if world.rank != 0:
        for t in (pair.hi, *lo):
            torch.distributed.send(t, dst=0)
        return
    hi_r, lo_r = torch.empty_like(pair.hi), [torch.empty_like(t) for t in lo]
    for r in range(1, world.size):
        for t in (hi_r, *lo_r):
            torch.distributed.recv(t, src=r)
        pair.merge(hi_r, lo_r)


def sum_counts(counts: list[int], world: World) -> list[int]:
    if not world.distributed:
        return counts
    t = torch.tensor(counts, dtype=torch.int64, device=_collective_device())
    torch.distributed.all_reduce(t)
    return [int(c) for c in t.cpu()]


def _collective_device() -> torch.device:
    """NCCL moves only CUDA tensors (this rank's GPU); gloo, host ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def solve_cost(rows: int, columns: int) -> int:
    """A solve's cost: rows·c² for the error propagation plus c³/3 for factorising H."""
    return columns * columns * (rows + columns // 3)


def assign_by_cost(costs: dict[str, int], world: World, busy: list[int] | None = None) -> dict[str, int]:
    """Each job → a rank: costliest first to the least loaded (``busy``: loads already given)."""
    load = list(busy) if busy is not None else [0] * world.size
    out = {}
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        r = min(range(world.size), key=lambda k: (load[k], k))
        out[name] = r
        load[r] += costs[name]
    return out


def expert_rounds(num_experts: int, world: World) -> list[dict[int, int]]:
    """One module's experts in rounds of at most one per rank (a rank holds one expert's Hessians).
    The first round is the short one; its idle ranks take the block's linears."""
    short = num_experts % world.size or world.size
    starts = [0, *range(short, num_experts, world.size)]
    return [{e: e - s for e in range(s, min(s + (short if s == 0 else world.size), num_experts))} for s in starts]


def share(results: dict, owner: dict[str, int], world: World) -> dict:
    """Every job's result on every rank, broadcast by its owner, in the order of ``owner``."""
    if not world.distributed:
        return results
    out = {}
    for name, r in owner.items():
        box = [results.get(name) if r == world.rank else None]
        torch.distributed.broadcast_object_list(box, src=r)
        out[name] = box[0]
    return out


def check_same_command(options: dict, world: World) -> None:
    """Refuse, on every rank, a run whose ranks were given different models, outputs or options."""
    if not world.distributed:
        return
    digests = [None] * world.size
    mine = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()
    torch.distributed.all_gather_object(digests, mine)
    odd = [r for r, h in enumerate(digests) if h != digests[0]]
    if odd:
        raise RanksDisagree(f"ranks {odd} were given a model, output or options that differ from rank 0's: every "
                            "rank must run the same command")


def agree_or_raise(error: BaseException | None, where: str, world: World) -> None:
    """Meet the other ranks; if any failed, every rank raises one :class:`RankFailed` naming it."""
    if not world.distributed:
        if error is not None:
            raise error
        return
    msgs = [None] * world.size
    torch.distributed.all_gather_object(msgs, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if failed:
        r, m = failed[0]
        raise RankFailed(f"rank {r} of {world.size} failed at {where}: {m}") from error


_step = ["the start"]   # the last step entered (:func:`together`): where a lost rank is reported


def lost_rank(error: BaseException) -> RankFailed | None:
    """A collective's failure because another rank died, as a :class:`RankFailed`; else None."""
    lost = isinstance(error, torch.distributed.DistError) or (
        isinstance(error, RuntimeError) and "gloo" in str(error) and "by peer" in str(error))
    if lost:
        stop_if_launcher_gone()
    return RankFailed(f"another rank stopped answering (it died or was killed: see its log) during "
                      f"{_step[0]}: {error}") if lost else None


@contextmanager
def together(where: str, world: World):
    """Run the body on every rank, then meet: an exception on any rank is raised on all."""
    _step[0] = where
    error = None
    try:
        with limits(f"running {where}"):
            yield
    except Exception as e:   # noqa: BLE001  (reported to every rank, then raised)
        if not world.distributed:
            raise
        error = e
    agree_or_raise(error, where, world)


def barrier(world: World) -> None:
    if world.distributed:
        torch.distributed.barrier()


@dataclass
class Job:
    """One solve run on one rank; ``release()`` drops what only this job needs."""
    name: str
    cost: int
    run: Callable[[], Any]
    release: Callable[[], None] | None = None


@dataclass
class RoundJobs:
    """``count`` equal-cost jobs with large inputs (experts), run in :func:`expert_rounds`.
    ``prepare(k)`` is collective; ``job(k, prepared)`` is job k."""
    name: str
    count: int
    cost: int
    prepare: Callable[[int], Any]
    job: Callable[[int, Any], Job]


class Scheduler:
    """Who solves what: :meth:`solve` yields every job's result in order, the same on every rank."""

    def __init__(self, world: World, portable: Callable[[Any], Any] = lambda result: result):
        self.world, self.portable = world, portable

    def solve(self, jobs: list[Job], rounds: list[RoundJobs], where: str) -> Iterator:
        """The results of ``jobs`` (balanced by cost), then of each of ``rounds``' jobs by index."""
        world = self.world
        first = expert_rounds(rounds[0].count, world)[0] if rounds else {}
        joined = world.distributed and 0 < len(first) < world.size
        busy = [rounds[0].cost if r in first.values() else 0 for r in range(world.size)] if joined else None
        assigned = assign_by_cost({j.name: j.cost for j in jobs}, world, busy)
        owner = {j.name: assigned[j.name] for j in jobs}   # in the jobs' order: the order results come back in
        for job in jobs:
            if owner[job.name] != world.rank and job.release is not None:
                job.release()
        if not joined:
            yield from self._meet({j.name: j for j in jobs}, owner, where)
        for k, held in enumerate(rounds):
            for r, dealt in enumerate(expert_rounds(held.count, world)):
                mine, order = {}, {}
                for e, rank in dealt.items():
                    prepared = held.prepare(e)   # collective
                    order[(held.name, e)] = rank
                    if rank == world.rank:
                        mine[(held.name, e)] = held.job(e, prepared)
                prepared = None
                at = f"{held.name}, experts {min(dealt)}..{max(dealt)}"
                if joined and k == 0 and r == 0:   # the jobs first, as one process orders their results
                    mine, order, at = {**{j.name: j for j in jobs}, **mine}, {**owner, **order}, f"{where} and {at}"
                yield from self._meet(mine, order, at)

    def _meet(self, jobs: dict, owner: dict, where: str) -> Iterator:
        """Run the ``jobs`` this rank owns, meet, and yield every result in ``owner``'s order."""
        if not self.world.distributed:   # each result is taken before the next job runs: one held at a time
            for key in owner:
                yield self._run(jobs[key])
            return
        mine = {}
        with together(where, self.world):
            for key, job in jobs.items():
                if owner[key] == self.world.rank:
                    mine[key] = self.portable(self._run(job))
        yield from share(mine, owner, self.world).values()

    def _run(self, job: Job):
        try:
            result = job.run()
        except Exception as e:
            if not self.world.distributed:
                raise
            raise RuntimeError(f"layer {job.name}: {type(e).__name__}: {e}") from e
        if job.release is not None:
            job.release()
        return result
