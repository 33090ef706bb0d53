"""The paper's accuracy study: ``python bench/accuracy.py [options]`` (``--help``; the code is in
``bench/study``, whose docstring describes the study)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: vllm_latq and bench.study

from bench.study.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
