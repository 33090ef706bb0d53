"""The solve scheduler (``quantize/ranks.py``): which rank runs which job, in what order every rank
receives the results, when a job's inputs are prepared and released — one process, and one rank
of three seen from inside (its collectives replaced by what the other ranks would answer)."""
from __future__ import annotations

from contextlib import contextmanager

import pytest

from vllm_latq.quantize import ranks
from vllm_latq.quantize.ranks import SINGLE, Job, RoundJobs, Scheduler, World


def _jobs(events: list, costs: dict[str, int]) -> list[Job]:
    return [Job(n, c, lambda n=n: events.append(f"run {n}") or n, lambda n=n: events.append(f"release {n}"))
            for n, c in costs.items()]


def _experts(events: list, count: int, cost: int = 5, fail: int | None = None) -> RoundJobs:
    def run(e):
        if e == fail:
            raise ValueError("boom")
        events.append(f"run m.{e}")
        return f"m.{e}"
    return RoundJobs("m", count, cost, lambda e: events.append(f"prepare {e}") or e,
                     lambda e, prepared: Job(f"m.{e}", cost, lambda: run(prepared)))


def test_one_process_runs_each_job_when_its_result_is_asked_for():
    events = []
    results = Scheduler(SINGLE).solve(_jobs(events, {"a": 1, "b": 9}), [_experts(events, 2)], "block 0")
    assert next(results) == "a" and events == ["run a", "release a"]   # nothing runs ahead of the caller
    assert list(results) == ["b", "m.0", "m.1"]
    assert events[2:] == ["run b", "release b", "prepare 0", "run m.0", "prepare 1", "run m.1"]


def test_one_process_raises_a_jobs_error_as_it_is():
    with pytest.raises(ValueError, match="boom"):
        list(Scheduler(SINGLE).solve([], [_experts([], 2, fail=1)], "block 0"))


@pytest.fixture
def rank_one_of_three(monkeypatch):
    """Rank 1 of 3: every meeting passes, and a result owned elsewhere arrives as ("from", rank)."""
    meetings = []

    @contextmanager
    def together(where, world):
        meetings.append(where)
        yield

    monkeypatch.setattr(ranks, "together", together)
    monkeypatch.setattr(ranks, "share", lambda mine, owner, world: {
        k: mine[k] if r == world.rank else ("from", r) for k, r in owner.items()})
    return World(1, 3), meetings


def test_a_rank_runs_its_share_and_receives_every_result_in_order(rank_one_of_three):
    """Two experts on three ranks leave rank 2 idle in their round: the linears go there first,
    costliest first (a: 9 beside nothing), then to the least loaded (b: rank 0); rank 1 runs only
    expert 1, prepares both (a collective), and gets every result in the order given."""
    world, meetings = rank_one_of_three
    events = []
    scheduler = Scheduler(world, portable=lambda result: f"portable {result}")
    results = list(scheduler.solve(_jobs(events, {"b": 4, "a": 9}), [_experts(events, 2)], "block 0"))
    assert results == [("from", 0), ("from", 2), ("from", 0), "portable m.1"]
    assert events == ["release b", "release a", "prepare 0", "prepare 1", "run m.1"]
    assert meetings == ["block 0 and m, experts 0..1"]


def test_linears_meet_on_their_own_when_the_experts_fill_every_rank(rank_one_of_three):
    world, meetings = rank_one_of_three
    events = []
    results = list(Scheduler(world).solve(_jobs(events, {"a": 1, "b": 1, "c": 1}), [_experts(events, 6)], "block 3"))
    assert results == [("from", 0), "b", ("from", 2), ("from", 0), "m.1", ("from", 2), ("from", 0), "m.4", ("from", 2)]
    assert events == ["release a", "release c", "run b", "release b", "prepare 0", "prepare 1", "prepare 2", "run m.1",
                      "prepare 3", "prepare 4", "prepare 5", "run m.4"]
    assert meetings == ["block 3", "m, experts 0..2", "m, experts 3..5"]


def test_a_failing_job_is_named_on_every_rank(rank_one_of_three):
    world, _ = rank_one_of_three
    with pytest.raises(RuntimeError, match=r"layer m\.1: ValueError: boom"):
        list(Scheduler(world).solve([], [_experts([], 2, fail=1)], "block 0"))
