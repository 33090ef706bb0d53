"""A stand-in for a GPU bench's timer where no GPU times anything (the tests, and the benches'
dry runs): every timed function runs once, so its calls are exercised, and no speed is claimed."""
from __future__ import annotations


class FakeTimer:
    """Runs the timed function once and returns 1, 2, 3 … µs, the first timed the fastest."""
    def __init__(self):
        self.n = 0

    def __call__(self, fn):
        fn()
        self.n += 1
        return float(self.n)
