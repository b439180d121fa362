"""What the router and the draft replica need to know of the target without loading its weights.

The router tokenizes prompts (chat template included) and checks them against the target's
context limit; the draft replica turns emitted ids into text and applies stop conditions. Both
need the *target's* tokenizer, context limit, EOS ids and emittable vocabulary, read here from the
model folder's tokenizer and config files (milliseconds, a few MB), never from its weights.

The router and target replicas hold no model and do not import torch
(``tests/deployments/test_lean_imports.py``): the router reads its :class:`TargetInfo` in a child
process (:meth:`TargetInfo.load_served`; transformers' ``AutoTokenizer`` imports torch), the
target replica finds the folder it hands to its TP ranks with :func:`target_folder`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from deployments.config import AppConfig


@dataclass(frozen=True)
class TargetInfo:
    """The target's tokenizer and limits.

    Attributes:
        name: the model spec text it was read for.
        tokenizer: the target's tokenizer (chat template included).
        max_positions: context limit in tokens.
        vocab_rows: logits width (``config.vocab_size``).
        eos_token_ids: every id that ends a generation (tokenizer EOS + generation config EOS).
    """

    name: str
    tokenizer: PreTrainedTokenizerBase
    max_positions: int
    vocab_rows: int
    eos_token_ids: tuple[int, ...]

    @property
    def emittable_vocab(self) -> int:
        """Ids below this bound may be proposed or emitted (as :attr:`LoadedModel.emittable_vocab`)."""
        return min(len(self.tokenizer), self.vocab_rows)

    @classmethod
    def load(cls, spec_text: str, weight_format: str | None = None) -> "TargetInfo":
        """Read the info of model spec ``spec_text`` (a demo role, an HF folder or a GGUF file).

        ``weight_format``: the format the target is served in (None: the CPU default), so that
        the folder read is the one its load builds anyway (a demo role is not converted twice).

        Raises:
            ModelLoadError: the model cannot be found or assembled.
        """
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from specdec.models.loaded import eos_token_ids
        from specdec.models.loader import resolve_folder

        folder = resolve_folder(spec_text, weight_format)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        config = AutoConfig.from_pretrained(folder)
        gen_config = None
        if os.path.exists(os.path.join(folder, "generation_config.json")):
            gen_config = GenerationConfig.from_pretrained(folder)
        eos = eos_token_ids(tokenizer, gen_config)
        return cls(
            name=spec_text,
            tokenizer=tokenizer,
            max_positions=int(config.max_position_embeddings),
            vocab_rows=int(config.vocab_size),
            eos_token_ids=tuple(eos),
        )

    @classmethod
    def load_served(cls, cfg: "AppConfig") -> "TargetInfo":
        """:meth:`load` of ``cfg``'s target in its served format (``cfg.target_format()``), without
        importing torch here: in a process that has not imported torch (a router replica), run in
        a child process (:func:`deployments.isolated.call_in_child`), whose tokenizer comes back
        pickled, the same object ``AutoTokenizer`` built (its class's module imports no torch); in
        a process that already holds torch (tests, a draft replica), here (the same function, no
        child's start-up).

        Raises:
            ModelLoadError: as :meth:`load`.
        """
        import sys

        if "torch" in sys.modules:
            return _load_served(cfg)
        from deployments.isolated import call_in_child

        return call_in_child(_load_served, cfg)

    def vocab_side(self):
        """The :class:`specdec.models.vocab.VocabSide` of the target (for the pair check)."""
        from specdec.models.vocab import VocabSide

        return VocabSide(f"target {self.name}", self.tokenizer, self.vocab_rows, self.eos_token_ids)


def _load_served(cfg: "AppConfig") -> TargetInfo:
    return TargetInfo.load(cfg.target_model, cfg.target_format())


def _resolve_served(cfg: "AppConfig") -> tuple[str, str]:
    from specdec.models.loader import resolve_folder

    fmt = cfg.target_format()
    return resolve_folder(cfg.target_model, fmt), fmt


def target_folder(cfg: "AppConfig") -> tuple[str, str]:
    """``(folder, weight format)`` of ``cfg``'s served target, for its TP ranks.

    Without torch when the format is given (``cfg.target_dtype``) and the folder is built
    (:func:`specdec.models.folders.built_folder`); else in a child process
    (:func:`deployments.isolated.call_in_child`: deciding the machine's default format and
    building a folder need torch; here when this process already imported torch), so the target
    replica never imports it.

    Raises:
        ModelLoadError: the folder cannot be found or built.
    """
    from specdec.models.folders import built_folder

    import sys

    folder = built_folder(cfg.target_model, cfg.target_dtype)
    if folder is not None:
        return folder, cfg.target_dtype
    if "torch" in sys.modules:  # nothing to keep out of this process
        return _resolve_served(cfg)
    from deployments.isolated import call_in_child

    return call_in_child(_resolve_served, cfg)
