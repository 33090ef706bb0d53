"""``python -m vllm_latq.quantize`` = ``latq-quantize``."""
import sys

from .cli import main

sys.exit(main())
