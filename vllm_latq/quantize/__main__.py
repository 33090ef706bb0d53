"""``python -m vllm_latq.quantize`` = ``latq-quantize``."""
import os
import sys

from .cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # a torchrun rank: see ranks.exit_rank
    from .ranks import exit_rank
    exit_rank(code)
sys.exit(code)
