"""The offline pipeline (``latq-quantize``): a Hugging Face causal LM → a latq checkpoint."""
