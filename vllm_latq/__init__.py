"""vllm-latq: weight-only quantization with error guarantees, served by vLLM."""
__version__ = "0.1.0"
