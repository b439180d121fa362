"""The in-memory form of a loaded model, shared by proposers and verifiers, a model's EOS ids, and
the tokenizer facts a process that holds no tokenizer keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: Any = None) -> list[int]:
    """All ids that end a generation: the tokenizer's EOS, then the generation config's
    ``eos_token_id`` (an int or a list), without repeats, in that order.

    The one place these facts are computed: :attr:`LoadedModel.eos_token_ids` passes the loaded
    model's ``generation_config``; the serving layer, which reads a model's files without its
    weights, passes the folder's ``generation_config.json`` (None when there is none).
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    extra = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(extra, int):
        extra = [extra]
    for i in extra or []:
        if int(i) not in ids:
            ids.append(int(i))
    return ids


@dataclass(frozen=True)
class TokenizerFacts:
    """What a model process that never encodes or decodes text needs of its tokenizer: its length
    (``len``, for :attr:`LoadedModel.emittable_vocab`), EOS id (for
    :attr:`LoadedModel.eos_token_ids`) and padding id (transformers' ``generate``), without the
    tokenizer itself.

    A TP rank (deployments/tp_load.py) only scores token ids, and a draft replica detokenizes with
    the target's tokenizer once its draft's vocabulary is checked against it; the demo pair's
    Qwen2 tokenizer takes about 150 MiB of a process's memory (the Rust tokenizer ~100 MiB, the
    rest transformers' Python side; measured on this machine), held for nothing there.

    Attributes:
        length: ``len(tokenizer)``: the ids it knows, added tokens included.
        eos_token_id: ``tokenizer.eos_token_id`` (None: none).
        pad_token_id: ``tokenizer.pad_token_id`` (None: none).
    """

    length: int
    eos_token_id: int | None
    pad_token_id: int | None = None

    def __len__(self) -> int:
        return self.length

    @classmethod
    def of(cls, tokenizer: "PreTrainedTokenizerBase | TokenizerFacts") -> "TokenizerFacts":
        """The facts of ``tokenizer`` (itself when it already is one)."""
        if isinstance(tokenizer, TokenizerFacts):
            return tokenizer
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        return cls(len(tokenizer), None if eos is None else int(eos), None if pad is None else int(pad))


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with its tokenizer and limits.

    Attributes:
        name: human-readable name used in errors and logs (e.g. ``"demo target
            (Qwen2.5-Coder-1.5B-Instruct)"`` or a folder path).
        model: the transformers causal LM, in eval mode.
        tokenizer: its tokenizer (fast tokenizer where available), or only the
            :class:`TokenizerFacts` of it in a process that never encodes or decodes text.
        max_positions: context limit in tokens (``config.max_position_embeddings``); no position
            at or beyond it is ever fed to the model.
        vocab_rows: rows of the output embedding (logits width); may exceed ``len(tokenizer)``
            when the matrix is padded (151936 vs 152064 for Qwen).
        weight_format: how the weights are stored and multiplied (:mod:`specdec.models.formats`).
        invariant: whether the forward is shape-invariant (:mod:`specdec.engine.invariant`): a
            position's logits do not depend on how many positions one forward scores.
        vocab_subset: a draft that scores only some token ids (FR-Spec,
            :mod:`specdec.models.vocab_subset`): ``[N]`` int64 ids, ascending, on :attr:`device`;
            the model's logits are ``[n, N]``, column j scoring ``vocab_subset[j]``
            (:meth:`full_logits` widens them back to ``vocab_rows``). None: all ``vocab_rows``.
        quant_cache: how int8/int4/w8a8 weights were obtained (:func:`specdec.models.quant_cache.quantize_cached`):
            ``"hit"`` read from the cache, ``"built"`` quantized and stored, ``"off"`` quantized
            without a cache, ``"none"`` a float format.
    """

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | TokenizerFacts
    max_positions: int
    vocab_rows: int
    weight_format: str = "float32"
    invariant: bool = False
    vocab_subset: torch.Tensor | None = None
    quant_cache: str = "none"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end a generation: the tokenizer's EOS and the generation config's
        (:func:`eos_token_ids`)."""
        return eos_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    @property
    def emittable_vocab(self) -> int:
        """Ids below this bound may be proposed or emitted (``min(len(tokenizer), vocab_rows)``)."""
        return min(len(self.tokenizer), self.vocab_rows)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits ``[n, N or V]`` as ``[n, vocab_rows]``: unchanged for a full-vocabulary
        model, -inf outside the subset for a vocabulary-subset draft
        (:func:`specdec.models.vocab_subset.expand_logits`)."""
        if self.vocab_subset is None:
            return logits
        from specdec.models.vocab_subset import expand_logits

        return expand_logits(logits, self.vocab_subset, self.vocab_rows)
