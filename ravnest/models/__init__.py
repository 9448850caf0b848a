"""Models as ordered blocks: the registry, built-in architectures and per-block cost profiles."""
from .registry import InputSpec, ModelError, ModelSpec, available_models, block_seed, build_model, register_model
from . import cnn, gpt, llama, mlp  # noqa: F401  (register the built-ins)
from .profile import BlockCost, input_bytes, profile_blocks, stage_input, state_shapes

__all__ = ["BlockCost", "InputSpec", "ModelError", "ModelSpec", "available_models", "block_seed", "build_model",
           "input_bytes", "profile_blocks", "register_model", "stage_input", "state_shapes"]
