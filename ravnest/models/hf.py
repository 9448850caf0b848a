"""Hugging Face's names for a `llama` model: its config.json and the key of every tensor, both ways.
A Ravnest key is "{block}.{name}" (block 0 the embedding, 1..L the layers, L + 1 the head); the
decoder layers' inner names are already Llama's, so only the prefixes differ:

    0.embed_tokens.weight                 <-> model.embed_tokens.weight
    3.self_attn.q_proj.weight             <-> model.layers.2.self_attn.q_proj.weight
    {L+1}.norm.weight                     <-> model.norm.weight
    {L+1}.lm_head.weight                  <-> lm_head.weight

A model trained with `residual_rank` is written in plain Llama form (subspace.py's `fold`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from ravnest.data.tokens import EOS

from .registry import ModelError, build_model
from .subspace import Subspace

CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
               "initializer_range")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_key(key: str, layers: int) -> str:
    """The Hugging Face name of a Ravnest llama state-dict key."""
    block, name = key.split(".", 1)
    index = int(block)
    if index == 0:
        return f"model.{name}"
    if index <= layers:
        return f"model.layers.{index - 1}.{name}"
    return name if name.startswith("lm_head.") else f"model.{name}"


def ravnest_key(name: str, layers: int) -> str:
    """The Ravnest key of a Hugging Face LlamaForCausalLM tensor name."""
    if (layer := _LAYER.match(name)) is not None:
        return f"{int(layer[1]) + 1}.{layer[2]}"
    if name.startswith("model.embed_tokens."):
        return f"0.{name.removeprefix('model.')}"
    if name.startswith("model.norm.") or name.startswith("lm_head."):
        return f"{layers + 1}.{name.removeprefix('model.')}"
    raise ModelError(f"llama: {name!r} is not a tensor of a Hugging Face LlamaForCausalLM")


def hf_config(cfg: dict[str, Any], dtype: str = "float32") -> dict[str, Any]:
    """config.json for `transformers.AutoConfig`: a LlamaForCausalLM with these settings."""
    heads = cfg["num_attention_heads"]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **{key: cfg[key] for key in CONFIG_KEYS},
            "head_dim": cfg["head_dim"] or cfg["hidden_size"] // heads, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "rope_theta": cfg["rope_theta"],
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]},
            "dtype": dtype, "torch_dtype": dtype,  # (transformers 5 reads the first, earlier versions the second)
            "use_cache": True}


def ravnest_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A `llama` config from a Hugging Face config.json (the keys Ravnest's llama has)."""
    if hf.get("model_type") != "llama":
        raise ModelError(f"llama: a Hugging Face {hf.get('model_type')!r} model is not a Llama")
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    scaling = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    if scaling != "default" or hf.get("rope_scaling"):
        raise ModelError(f"llama: rope scaling ({scaling}) is not supported; only plain rotary positions are")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ModelError("llama: attention_bias and mlp_bias are not supported")
    config = {key: hf[key] for key in CONFIG_KEYS if key in hf}
    return {**config, "rope_theta": float(theta), "head_dim": hf.get("head_dim") or 0,
            "residual_rank": 0}  # (its layers write into the whole residual stream)


def hf_texts(ref: dict[str, Any], dtype: str = "float32", tokenizer: str | None = None) -> dict[str, str]:
    """The text files of a Hugging Face folder for the model `ref` ({"name": "llama", "config": ...}):
    config.json, and with `tokenizer` (a tokenizer.json's text) the files `AutoTokenizer` loads.
    The weights (model.safetensors, under `hf_key`'s names) are written by the caller."""
    if ref.get("name") != "llama":
        raise ModelError(f"only llama models have a Hugging Face form, not {ref.get('name')!r}")
    cfg = build_model("llama", ref.get("config") or {}).config
    texts = {"config.json": json.dumps(hf_config(cfg, dtype), indent=2) + "\n"}
    return {**texts, **(tokenizer_texts(tokenizer, cfg["max_position_embeddings"]) if tokenizer else {})}


def tokenizer_texts(tokenizer: str, max_length: int) -> dict[str, str]:
    """tokenizer.json (its text as given) and the tokenizer_config.json that makes `AutoTokenizer` load it."""
    return {"tokenizer.json": tokenizer,
            "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS,
                                                 "model_max_length": max_length}, indent=2) + "\n"}


def write_hf_folder(model_file: Path, folder: Path, tokenizer: str | None = None) -> None:
    """A Ravnest model file (`ravnest download`) as a Hugging Face model folder, here: config.json and
    model.safetensors under Llama's names, which `transformers.AutoModelForCausalLM.from_pretrained`
    loads, and the tokenizer: `tokenizer` (a tokenizer.json's text), else the one the job recorded
    (the model file's metadata). The coordinator makes the same folder for `?format=hf`."""
    with safe_open(str(model_file), "pt") as handle:
        metadata = handle.metadata() or {}
        ref = json.loads(metadata.get("model", "{}"))
        hf_texts(ref)  # (a llama, with a valid config)
        spec = build_model("llama", ref["config"])
        layers, subspace = spec.config["num_hidden_layers"], Subspace.of(spec.config)
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        tensors = {hf_key(key, layers): t for key, t in (subspace.fold(tensors) if subspace else tensors).items()}
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    folder.mkdir(parents=True, exist_ok=True)
    texts = hf_texts(ref, dtypes.pop() if len(dtypes) == 1 else "float32", tokenizer or metadata.get("tokenizer"))
    for name, text in texts.items():
        (folder / name).write_text(text)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
