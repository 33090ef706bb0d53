"""The test suite's durations report (docs/TEST_DURATIONS.md) from pytest's JUnit XML: the wall time,
the machine's load, the summed test time per test folder and the slowest tests (setup, call and
teardown together; with parallel workers the sums exceed the wall time).

    python -m pytest -q -n 2 --dist loadfile --junitxml=/tmp/d.xml -o junit_duration_report=total
    python -m tools.test_durations /tmp/d.xml --top 25 --label "default suite, 2 workers"
"""
from __future__ import annotations

import argparse
import collections
import os
import xml.etree.ElementTree as ET


def read(path: str) -> tuple[float, list[tuple[str, float, str]]]:
    """(the suite's wall seconds, [(test id, seconds, outcome)]) from a JUnit XML file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = []
    for c in suite.iter("testcase"):
        module = c.get("classname", "").replace(".", "/")
        outcome = next((k.tag for k in c if k.tag in ("failure", "error", "skipped")), "passed")
        cases.append((f"{module}::{c.get('name')}", float(c.get("time", 0)), outcome))
    return float(suite.get("time", 0)), cases


def folder_of(test_id: str) -> str:
    parts = test_id.split("::")[0].split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def report(path: str, top: int, label: str) -> str:
    wall, cases = read(path)
    per_folder = collections.defaultdict(lambda: [0.0, 0])
    for test_id, t, outcome in cases:
        per_folder[folder_of(test_id)][0] += t
        per_folder[folder_of(test_id)][1] += outcome == "passed"
    counts = collections.Counter(outcome for _, _, outcome in cases)
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"
    lines = [f"### {label}", "",
             f"wall {wall / 60:.1f} min; {', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}; "
             f"load average at the end (1, 5, 15 min): {load}", "",
             "| folder | tests passed | summed test time (s) |", "|---|---|---|"]
    lines += [f"| {f} | {n} | {t:.0f} |" for f, (t, n) in sorted(per_folder.items(), key=lambda kv: -kv[1][0])]
    lines += ["", f"slowest {top} (setup + call + teardown, s):", "", "```"]
    lines += [f"{t:8.1f}  {test_id}" for test_id, t, _ in sorted(cases, key=lambda c: -c[1])[:top]]
    return "\n".join(lines + ["```", ""])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml", help="pytest's --junitxml file")
    ap.add_argument("--top", type=int, default=25, help="how many of the slowest tests to list")
    ap.add_argument("--label", default="suite", help="the report's heading")
    args = ap.parse_args(argv)
    print(report(args.xml, args.top, args.label))


if __name__ == "__main__":
    main()
