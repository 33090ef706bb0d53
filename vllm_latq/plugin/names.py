"""The names latq registers with vLLM, vLLM-free (latq-serve reads them before vLLM starts)."""

QUANT_NAME = "latq"    # the quantization method
LOAD_FORMAT = "latq"   # the --load-format of latq's loader (weights.LatqModelLoader)
