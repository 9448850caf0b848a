"""Ravnest: train large neural networks together on ordinary, unequal machines."""

__version__ = "0.1.0"


def load_model(path, device="cpu"):
    """The model a job trained (`ravnest download JOB -o model.safetensors`), as a ready torch.nn.Module
    in eval mode: the file names its architecture and config (metadata "model"), which are built
    from the registry, then its weights are loaded (safetensors: nothing is unpickled)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    from ravnest.models import build_model

    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
    if "model" not in metadata:
        raise ValueError(f"{path} does not name its model (metadata 'model'): is it a Ravnest download?")
    ref = json.loads(metadata["model"])
    spec = build_model(ref["name"], ref.get("config") or {})
    model = spec.full_model(device=device)
    model.load_state_dict(load_file(str(path), device=str(device)))
    model.ravnest_spec = spec  # what it is: its task, input and config (ravnest generate reads it)
    return model.eval()
