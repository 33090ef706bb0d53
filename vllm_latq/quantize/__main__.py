"""``python -m vllm_latq.quantize`` = ``latq-quantize``."""
import sys

from ..commands.quantize import main
from .ranks import exit_rank, launched_ranks

code = main()
if launched_ranks() > 1:   # a torchrun rank: see exit_rank
    exit_rank(code)
sys.exit(code)
