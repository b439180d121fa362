"""The in-memory form of a loaded model, shared by proposers and verifiers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with its tokenizer and limits.

    Attributes:
        name: human-readable name used in errors and logs (e.g. ``"demo target
            (Qwen2.5-Coder-1.5B-Instruct)"`` or a folder path).
        model: the transformers causal LM, in eval mode.
        tokenizer: its tokenizer (fast tokenizer where available).
        max_positions: context limit in tokens (``config.max_position_embeddings``); no position
            at or beyond it is ever fed to the model.
        vocab_rows: rows of the output embedding (logits width); may exceed ``len(tokenizer)``
            when the matrix is padded (151936 vs 152064 for Qwen).
    """

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    max_positions: int
    vocab_rows: int

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end a generation: the tokenizer's EOS and the generation config's."""
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        gen = getattr(self.model, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(extra, int):
            extra = [extra]
        for i in extra or []:
            if int(i) not in ids:
                ids.append(int(i))
        return ids

    @property
    def emittable_vocab(self) -> int:
        """Ids below this bound may be proposed or emitted (``min(len(tokenizer), vocab_rows)``)."""
        return min(len(self.tokenizer), self.vocab_rows)
