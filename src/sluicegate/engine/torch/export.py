"""Write a model as a Hugging Face directory (``sluicegate export-hf``).

The embedded engine reads a GGUF file; the engines Sluicegate fronts in upstream mode
(vLLM, TGI, ``transformers serve``) want a Hugging Face directory. Exporting the GGUF's
dequantised weights lets both serve exactly the same model, which is what the upstream
tests and benchmarks compare.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save_file

from sluicegate.engine.torch.convert import hf_config_dict, to_hf_state_dict
from sluicegate.engine.torch.loader import load_checkpoint

#: Files a Hugging Face Llama directory needs; written last is ``config.json``, so a
#: directory with a config is complete.
EXPORTED_FILES = (
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "config.json",
)


def export_hf_directory(
    model_path: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    dtype: str = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``model_path`` (a GGUF file, a Hugging Face directory, or None for the
    default SmolLM2 GGUF) to ``out_dir`` as ``LlamaForCausalLM`` safetensors, config,
    tokenizer and chat template. Returns the directory."""
    checkpoint = load_checkpoint(model_path, dtype=dtype, cache_dir=cache_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = checkpoint.args
    state = to_hf_state_dict(args, checkpoint.state_dict)
    if args.tie_word_embeddings:
        del state["lm_head.weight"]  # shared with the embedding; safetensors refuses both
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    tokenizer = checkpoint.tokenizer
    tokenizer.save(str(out / "tokenizer.json"))
    template = tokenizer.chat_template
    eos_ids = list(tokenizer.eos_token_ids)
    backend = tokenizer.tokenizer
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template.source,
        "bos_token": template.bos_token or None,
        "eos_token": template.eos_token or backend.id_to_token(eos_ids[0]),
        "add_bos_token": tokenizer.add_bos_token_id is not None,
        "model_max_length": args.max_position_embeddings,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    recommended = {k: v for k, v in checkpoint.sampling.to_json().items() if v is not None}
    generation = {"eos_token_id": eos_ids, **recommended}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    config = hf_config_dict(args) | {"eos_token_id": eos_ids, "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
