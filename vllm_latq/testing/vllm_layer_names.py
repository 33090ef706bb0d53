"""vLLM's own model classes (tiny) built with latq's quant config, in a process of their
own (vLLM's distributed state is global): the module and inlier bits each latq layer's loader expects."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .boundary_run import WORKER_ENV, free_port, init_ranks


def config_dir(root: Path, model_type: str, **sizes) -> Path:
    """A directory holding only a tiny untied ``model_type``'s ``config.json``, ``architectures`` as saved."""
    from transformers import AutoConfig

    from .. import hf_model
    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  tie_word_embeddings=False, max_position_embeddings=128, **sizes)
    config.architectures = [type(hf_model.empty_model(config)).__name__]
    out = root / model_type
    config.save_pretrained(out)
    return out


def latq_layers(model_dir: str, quantization_config: dict) -> dict:
    """vLLM's model of ``model_dir`` built: ``layers`` (vLLM prefix → [module, inlier bits] of each latq
    layer), ``asked`` (the prefixes vLLM asked latq for a method), ``processed`` (why its first latq layer
    refuses to be processed without tensors); or ``error``, the build's refusal."""
    import torch
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    from ..plugin.config import LatqConfig
    model_config = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                               enforce_eager=True)
    quant, asked = LatqConfig(quantization_config), []
    ask = quant.get_quant_method
    quant.get_quant_method = lambda layer, prefix: asked.append(prefix) or ask(layer, prefix)
    config = VllmConfig(model_config=model_config, quant_config=quant)
    try:
        with set_current_vllm_config(config), torch.device("cpu"):
            model = initialize_model(config, prefix="")   # the engine's own call: the model at the root
    except (NotImplementedError, ValueError) as e:
        return {"error": str(e)}
    latq = [m for _, m in model.named_modules() if hasattr(m, "_latq_load")]
    layers = {m.prefix: [m._latq_load.prefix, m._latq_load.bits] for m in latq}
    try:   # the first layer processed with none of its tensors loaded: what it says first
        with set_current_vllm_config(config):
            latq[0].quant_method.process_weights_after_loading(latq[0])
    except ValueError as e:
        return {"asked": asked, "layers": layers, "processed": str(e)}
    raise AssertionError(f"{latq[0].prefix} was processed without its tensors")


def run(cases: list[tuple[Path, dict]], timeout: float = 600) -> list[dict]:
    """:func:`latq_layers` of each (model directory, quantization_config), in one fresh process."""
    spec, dest = (Path(cases[0][0]).parent / f"layer-names-{x}.json" for x in ("cases", "layers"))
    spec.write_text(json.dumps([[str(d), qc] for d, qc in cases]))
    p = subprocess.run([sys.executable, "-m", __name__, str(spec), str(dest)], env={**os.environ, **WORKER_ENV},
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode or not dest.exists():
        raise RuntimeError(f"building vLLM's models exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}")
    return json.loads(dest.read_text())


def main(spec: str, dest: str) -> None:
    init_ranks(1, 0, free_port())
    layers = [latq_layers(d, qc) for d, qc in json.load(open(spec))]
    Path(dest).write_text(json.dumps(layers))


if __name__ == "__main__":
    main(*sys.argv[1:])
