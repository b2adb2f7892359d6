"""GLM-5.3-Flash (Hugging Face ``glm5_next`` text model) on megatron-core."""

from .config import ModelConfig
from .presets import PRESETS, get_preset

__all__ = ["ModelConfig", "PRESETS", "get_preset"]
