"""The offline pipeline (``latq-quantize``): a Hugging Face causal LM and calibration text → a
latq checkpoint, one decoder block at a time. The algorithms it applies are ``vllm_latq.algorithms``."""
