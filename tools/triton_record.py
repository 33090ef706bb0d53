"""The committed compile record (``tools/compile_record.json``): every job's summary row
(:func:`tools.triton_compile.summarize`) with the Triton, the summary and each kernel's device code it was
compiled from — written by ``python -m tools.triton_compile --record``, read by the tests, the launch table
and the cost fit, which check it is current instead of compiling the whole sweep.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tools import triton_compile as tc

RECORD_FILE = Path(__file__).with_name("compile_record.json")
RECORD_FIELDS = ("regs", "spill_stores", "spill_loads", "stack", "smem", "sass_total",
                 *tc.SASS_GROUPS, "loop", "ipw", "ldg_width", "ldg_min", "ctas_sm", "inflight_sm")


def _record_values(row: dict) -> list:
    return [round(row[f], 4) if f == "ipw" and row[f] is not None else row[f] for f in RECORD_FIELDS]


def dumps_record(jobs: list[dict], rows: list[dict]) -> str:
    """The summary rows of every job as committed JSON: the Triton and the code each kernel was
    compiled from, then per set of job fields one line per job (its values, then ``RECORD_FIELDS``)."""
    bad = [r for r in rows if "error" in r]
    if bad:
        raise ValueError("a record holds compiled jobs only; these failed:\n" + tc.report(bad))
    groups: dict[tuple, list] = {}
    for j, r in sorted(zip(jobs, rows), key=lambda jr: tc.job_key(jr[0])):
        fields = tuple(sorted(j))
        groups.setdefault(fields, []).append([j[f] for f in fields] + _record_values(r))
    head = {"triton": tc.triton_version(), "summary": summary_hash(),
            "code": {k: tc.code_hash(k) for k in sorted({j["kernel"] for j in jobs})},
            "result_fields": list(RECORD_FIELDS)}
    blocks = [f'{{"job_fields": {json.dumps(list(fields))}, "rows": [\n'
              + ",\n".join(json.dumps(v, separators=(",", ":")) for v in vals) + "\n]}"
              for fields, vals in sorted(groups.items())]
    return json.dumps(head, sort_keys=True)[:-1] + ', "groups": [\n' + ",\n".join(blocks) + "\n]}\n"


def read_record(path: Path = RECORD_FILE) -> dict:
    """{"triton", "summary", "code": {kernel: code hash}, "rows": {job key: summary row}}."""
    try:
        raw = json.loads(Path(path).read_text())
        rows = {}
        for g in raw["groups"]:
            n = len(g["job_fields"])
            for v in g["rows"]:
                job = dict(zip(g["job_fields"], v[:n]))
                rows[tc.job_key(job)] = {**job, **dict(zip(raw["result_fields"], v[n:], strict=True)),
                                      "smem_limit": tc.TARGETS[job["cc"]]}
        return {"triton": raw["triton"], "summary": raw["summary"], "code": raw["code"], "rows": rows}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"compile record {path}: unreadable ({e}); write it with "
                         "`python -m tools.triton_compile --record`") from e


def current_rows(jobs: list[dict]) -> dict:
    """The committed record's rows of ``jobs`` whose kernel it describes as this checkout and Triton would
    compile it (the same device code, Triton and summary): {job key: row}; none from an unreadable record."""
    try:
        record = read_record()
    except ValueError:
        return {}
    if record["triton"] != tc.triton_version() or record["summary"] != summary_hash():
        return {}
    changed = changed_kernels(record, jobs)
    return {tc.job_key(j): record["rows"][tc.job_key(j)] for j in jobs
            if j["kernel"] not in changed and tc.job_key(j) in record["rows"]}


def changed_kernels(record: dict, jobs: list[dict]) -> list[str]:
    """The kernels of ``jobs`` whose device code (or job source) is not the one ``record`` was compiled from."""
    return [k for k in sorted({j["kernel"] for j in jobs}) if record["code"].get(k) != tc.code_hash(k)]


def summary_hash() -> str:
    """What a record row depends on beyond the compile: :func:`tools.triton_compile.summarize` and the fields it keeps."""
    import inspect
    from tools import compile_proxies
    from vllm_latq.kernels.triton.layout import step_of
    src = "".join(inspect.getsource(f) for f in (tc.summarize, step_of, _record_values, compile_proxies)) \
        + repr(RECORD_FIELDS)
    return hashlib.sha256(tc._code_fingerprint(src).encode()).hexdigest()[:16]


def record_staleness(record: dict, jobs: list[dict]) -> list[str]:
    """Why ``record`` does not describe compiling ``jobs`` with this checkout and Triton (empty:
    it does)."""
    why = []
    if record["triton"] != tc.triton_version():
        why.append(f"compiled with Triton {record['triton']}, this environment has {tc.triton_version()}")
    if record["summary"] != summary_hash():
        why.append("the summary of a compile (tools/triton_compile.summarize) changed")
    why += [f"{k}: its device code or its job's source changed" for k in changed_kernels(record, jobs)]
    keys, held = {tc.job_key(j) for j in jobs}, set(record["rows"])
    if keys != held:
        why.append(f"{len(keys - held)} jobs missing, {len(held - keys)} no longer compiled")
    return why


def record_mismatches(jobs: list[dict], rows: list[dict], record: dict) -> list[str]:
    """Where the summary rows of ``jobs`` compiled afresh differ from the record's (empty: nowhere)."""
    out = []
    for j, r in zip(jobs, rows, strict=True):
        want = record["rows"].get(tc.job_key(j))
        if want is None or "error" in r:
            out.append(f"{tc.job_key(j)}: {'not in the record' if want is None else r['error'].splitlines()[-1]}")
            continue
        diff = [f"{f} {v} (record {want[f]})" for f, v in zip(RECORD_FIELDS, _record_values(r)) if v != want[f]]
        if diff:
            out.append(f"{tc.job_key(j)}: " + ", ".join(diff))
    return out
