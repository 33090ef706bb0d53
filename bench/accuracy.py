"""The paper's accuracy study: ``python -m bench.accuracy [options]`` (``--help``; the code is in
``bench/study``, whose docstring describes the study)."""
import sys

from bench.study.cli import main

if __name__ == "__main__":
    sys.exit(main())
