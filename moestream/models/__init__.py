"""One file per Hugging Face `model_type`, found through an importlib registry."""

from __future__ import annotations

import importlib
from types import ModuleType

from moestream.config import SUPPORTED_MODEL_TYPES, ConfigError


def model_module(model_type: str) -> ModuleType:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return importlib.import_module(f"moestream.models.{model_type}")
