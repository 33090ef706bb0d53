"""Benchmarks and the accuracy study (``bench/study``); each ``bench/*.py`` also runs as a script."""
