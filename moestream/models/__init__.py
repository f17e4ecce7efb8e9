"""One file per Hugging Face `model_type`, found by scanning this package.

A model file is a module of this package that defines `build(args)`. It also owns its config.json
mapping: `config_fields(cfg, path)` returns its ModelArgs fields over `config.common_fields`,
an optional `normalize_config(cfg)` first rewrites its own spellings (nested `text_config`,
renamed keys, transformers' defaults), and `ALIASES` lists other model_type names it runs.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from moestream.config import (
    ConfigError,
    ModelArgs,
    check_config_values,
    common_fields,
    read_config_json,
)


@functools.cache
def _model_files() -> dict[str, ModuleType]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if callable(getattr(module, "build", None)):
            found[info.name] = module
    return found


@functools.cache
def _aliases() -> dict[str, str]:
    return {a: name for name, m in _model_files().items() for a in getattr(m, "ALIASES", ())}


def supported_model_types() -> tuple[str, ...]:
    """Every model file's model_type (aliases not included), sorted."""
    return tuple(_model_files())


def model_module(model_type: str, path: str | None = None) -> ModuleType:
    """The model file that runs `model_type` (or one of its aliases)."""
    module = _model_files().get(_aliases().get(model_type, model_type))
    if module is None:
        where = f"{path}: " if path else ""
        raise ConfigError(
            f"{where}model_type {model_type!r} is not supported; "
            f"supported: {', '.join(supported_model_types())}"
        )
    return module


def model_args_from_dict(cfg: dict[str, Any], path: str = "config.json") -> ModelArgs:
    """Build ModelArgs from a Hugging Face config dict through its model file's mapping."""
    mt = cfg.get("model_type")
    if mt is None:
        raise ConfigError(
            f"{path}: no 'model_type' field; is this a Hugging Face checkpoint folder?"
        )
    module = model_module(mt, path)
    normalize = getattr(module, "normalize_config", None)
    if normalize is not None:
        cfg = normalize(cfg)
    check_config_values(cfg, path)
    fields = common_fields(cfg, path)
    fields.update(module.config_fields(cfg, path))
    return ModelArgs(model_type=module.__name__.rpartition(".")[2], **fields)


def load_model_args(folder: str | Path) -> ModelArgs:
    """ModelArgs of a checkpoint folder's config.json."""
    return model_args_from_dict(*read_config_json(folder))


def checkpoint_renamer(model_type: str) -> Callable[[str], str]:
    """Checkpoint tensor name -> ours, by the model file's `RENAMES` (substring pairs)."""
    renames = getattr(model_module(model_type), "RENAMES", ())

    def ours(name: str) -> str:
        for theirs_part, ours_part in renames:
            name = name.replace(theirs_part, ours_part)
        return name

    return ours
