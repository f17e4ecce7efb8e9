"""The model registry: found from the model files, each owning its config mapping; config.py
stays architecture-neutral and never imports the models package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import moestream
import moestream.models as models
from moestream.config import ConfigError

PACKAGE = Path(moestream.__file__).parent


def _top_level_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_registry_lists_exactly_the_model_files():
    files = sorted((PACKAGE / "models").glob("*.py"))
    with_build = [p.stem for p in files if "build" in _top_level_functions(p)]
    assert models.supported_model_types() == tuple(sorted(with_build))
    assert len(with_build) >= 9
    for name in with_build:  # every model file maps its own config.json
        assert callable(models.model_module(name).config_fields), name


def test_aliases_resolve_to_their_model_file():
    assert models.model_module("qwen3_5_moe_text") is models.model_module("qwen3_5_moe")
    with pytest.raises(ConfigError, match=r"x/config.json: model_type 'llama' is not supported"):
        models.model_args_from_dict({"model_type": "llama"}, "x/config.json")
    with pytest.raises(ConfigError, match="supported: .*qwen3_moe"):
        models.model_module("llama")


def test_config_does_not_import_models():
    tree = ast.parse((PACKAGE / "config.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + [
        n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
    ]
    assert not [m for m in imported if m.startswith("moestream")], imported
    code = (
        "import sys, moestream.config; "
        "sys.exit(any(m.startswith('moestream.models') for m in sys.modules))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
