"""A draft that scores only the most frequent tokens: FR-Spec's vocabulary subset.

Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling" (arXiv:2502.14856): in a small draft with a large vocabulary the output
layer dominates the per-token cost (the demo draft, Qwen2.5-Coder 0.5B: hidden 896, 151,936
vocabulary rows, about 38 % of its per-token weights). The draft keeps only the rows of the N
most frequent token ids, sliced once at load; the target keeps the full vocabulary.

- **The table** (:class:`FrequencyTable`): token ids ranked by how often they occur in a corpus,
  for one tokenizer (its identity, :func:`tokenizer_identity`: vocabulary size and a sha256 of
  the token-to-id map, is stored with it and checked on use). The one the package ships,
  ``specdec/data/qwen2.5-token-ranks.json.gz``, is made by ``scripts/vocab_table.py`` from the
  Python standard library's sources and docs (see ``docs/bench/vocab/README.md``).
- **The subset** (:func:`subset_ids`): the model's EOS ids first, then the ranking, N ids in all,
  ascending; ids the table never saw follow in id order when N exceeds what it ranks.
- **The slicing** (:func:`slice_output_layer`): a new output layer over those rows, in every
  weight format: a float layer is sliced (before int8/int4 quantization, so the quantized layer
  is quantized from the sliced rows); an already int8-quantized layer is sliced row by row
  (data and scales). The input embeddings stay whole: any token (a target's bonus token outside
  the subset included) can be fed.
- **The logits** (:func:`expand_logits`): the ``[n, N]`` logits go back to the full width with
  -inf outside the subset, so every processor, warper and the greedy tie-break run unchanged and
  the draft's distribution q is exactly the one it samples from: zero outside the subset,
  renormalised over it after the request's processors. Rejection sampling (Leviathan et al.
  2023, §2.3; Chen et al. 2023) is exact for any q the verifier knows, so the output keeps the
  target's distribution; under greedy decoding the output is the target's argmax path.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec.errors import ModelCompatibilityError, ModelLoadError

#: file-format tag of a table
TABLE_FORMAT = "specdec-token-ranks/1"
#: the table shipped in the package (Qwen2/Qwen2.5 tokenizer: the demo pair)
DEFAULT_TABLE = "qwen2.5-token-ranks.json.gz"


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> dict:
    """The identity a frequency table is bound to.

    Returns:
        ``{"vocab_size": len(tokenizer), "sha256": hex}``, the hash over the token-to-id map
        (added tokens included), serialised as JSON sorted by id, so two tokenizers that map every
        token to the same id have the same identity whatever their files look like.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    text = json.dumps(vocab, ensure_ascii=False, separators=(",", ":"))
    return {"vocab_size": len(tokenizer), "sha256": hashlib.sha256(text.encode()).hexdigest()}


@dataclass
class FrequencyTable:
    """Token ids ranked by frequency in a corpus, for one tokenizer.

    Attributes:
        tokenizer: :func:`tokenizer_identity` of the tokenizer that produced the counts.
        ranked_ids: ids seen in the corpus, most frequent first (ties: lower id first).
        counts: occurrences of each ranked id (same order), in tokens.
        source: where the corpus came from (free text, kept with the table).
        name: where the table was read from (for error messages).
    """

    tokenizer: dict
    ranked_ids: list[int]
    counts: list[int]
    source: str = ""
    name: str = "<table>"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_counts(cls, tokenizer: PreTrainedTokenizerBase, counts: Counter, source: str, **extra) -> "FrequencyTable":
        """Rank ``counts`` (token id -> occurrences) for ``tokenizer``."""
        ranked = sorted(((int(i), int(c)) for i, c in counts.items() if c > 0), key=lambda ic: (-ic[1], ic[0]))
        return cls(tokenizer_identity(tokenizer), [i for i, _ in ranked], [c for _, c in ranked], source,
                   extra=dict(extra))

    @classmethod
    def from_texts(cls, tokenizer: PreTrainedTokenizerBase, texts: Iterable[str], source: str) -> "FrequencyTable":
        """Count the tokens of ``texts`` (each tokenized alone, no special tokens added) and rank them."""
        counts: Counter = Counter()
        for text in texts:
            counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
        return cls.from_counts(tokenizer, counts, source)

    def save(self, path: str | Path) -> None:
        """Write the table as gzip'd JSON (deterministic bytes: no timestamp in the gzip header)."""
        data = {"format": TABLE_FORMAT, "tokenizer": self.tokenizer, "source": self.source, **self.extra,
                "tokens_counted": sum(self.counts), "ranked_ids": self.ranked_ids, "counts": self.counts}
        raw = json.dumps(data, separators=(",", ":")).encode()
        with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
            gz.write(raw)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "FrequencyTable":
        """Read a table (None: the one shipped in the package, :data:`DEFAULT_TABLE`).

        Raises:
            ModelLoadError: the file is missing or not a table.
        """
        try:
            if path is None:
                raw = resources.files("specdec.data").joinpath(DEFAULT_TABLE).read_bytes()
                name = f"specdec/data/{DEFAULT_TABLE}"
            else:
                raw = Path(path).read_bytes()
                name = str(path)
            data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
        except (OSError, ValueError, EOFError, zlib.error) as e:
            raise ModelLoadError(f"cannot read token frequency table {path or DEFAULT_TABLE}: {e}") from e
        if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
            raise ModelLoadError(f"{name} is not a token frequency table (expected format {TABLE_FORMAT!r})")
        extra = {k: v for k, v in data.items()
                 if k not in ("format", "tokenizer", "source", "ranked_ids", "counts", "tokens_counted")}
        try:
            return cls(dict(data["tokenizer"]), [int(i) for i in data["ranked_ids"]],
                       [int(c) for c in data["counts"]], str(data.get("source", "")), name, extra)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{name} is a damaged token frequency table ({type(e).__name__}: {e})") from None

    def check_tokenizer(self, tokenizer: PreTrainedTokenizerBase, model_name: str = "the model") -> None:
        """Refuse a tokenizer the table was not made for.

        Raises:
            ModelCompatibilityError: the vocabulary size or the hash of the token-to-id map differs.
        """
        ident = tokenizer_identity(tokenizer)
        if ident != self.tokenizer:
            raise ModelCompatibilityError(
                f"token frequency table {self.name} was made for another tokenizer "
                f"({self.tokenizer.get('vocab_size')} tokens, sha256 {str(self.tokenizer.get('sha256'))[:12]}...) "
                f"than {model_name}'s ({ident['vocab_size']} tokens, sha256 {ident['sha256'][:12]}...); "
                "regenerate it for this tokenizer (scripts/vocab_table.py --tokenizer FOLDER) or turn the "
                "draft vocabulary subset off")

    def coverage(self, n: int) -> float:
        """Fraction of the counted tokens that the ``n`` most frequent ids cover."""
        total = sum(self.counts)
        return sum(self.counts[:n]) / total if total else 0.0


def subset_ids(table: FrequencyTable, tokenizer: PreTrainedTokenizerBase, n: int, emittable: int,
               always: Sequence[int] = (), model_name: str = "the model") -> torch.Tensor:
    """The ``n`` token ids a vocabulary-subset draft scores.

    ``always`` (the model's EOS ids) first, then the table's ranking; when ``n`` exceeds what the
    table ranks, the remaining ids follow in id order. Only ids below ``emittable`` are taken.

    Args:
        table: a frequency table for ``tokenizer``.
        tokenizer: the draft's tokenizer (checked against the table).
        n: subset size, 1..emittable.
        emittable: ids below this may be emitted (``LoadedModel.emittable_vocab``).
        always: ids that are in the subset whatever their rank.

    Returns:
        ``[n]`` int64, ascending, unique, all ``< emittable`` (CPU).

    Raises:
        ModelLoadError: ``n`` outside 1..emittable.
        ModelCompatibilityError: the table belongs to another tokenizer.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= emittable:
        raise ModelLoadError(
            f"draft vocabulary subset must be an integer from 1 to {emittable} (the tokens {model_name} can "
            f"emit), got {n!r}")
    table.check_tokenizer(tokenizer, model_name)
    chosen: dict[int, None] = {}
    for i in list(always) + table.ranked_ids:
        if len(chosen) == n:
            break
        if 0 <= int(i) < emittable:
            chosen.setdefault(int(i), None)
    i = 0
    while len(chosen) < n:
        chosen.setdefault(i, None)
        i += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def slice_output_layer(model: PreTrainedModel, ids: torch.Tensor) -> nn.Module:
    """Replace ``model``'s output layer with one over the rows ``ids`` only (in place).

    The input embedding is left whole (also when the output layer was tied to it), so every id
    can still be fed. Supported layers: ``nn.Linear`` with plain float weights (float32/bfloat16/
    float16, and int8/int4 before they are quantized: :func:`specdec.models.loader.load_model`
    slices first) and :class:`specdec.models.formats.Int8WeightOnlyLinear` /
    :class:`specdec.models.formats.W8A8Linear` (data and per-row scales sliced).

    Args:
        model: a transformers causal LM.
        ids: ``[N]`` int64 row ids, ascending.

    Returns:
        the new output layer (``out_features == N``).

    Raises:
        ModelLoadError: the output layer is of another kind (e.g. already int4-packed by torchao:
            slice before quantizing).
    """
    from specdec.models.formats import Int8WeightOnlyLinear, W8A8Linear

    head = model.get_output_embeddings()
    ids = ids.to(torch.long)
    with torch.no_grad():
        if isinstance(head, (Int8WeightOnlyLinear, W8A8Linear)) and not getattr(head, "prepacked", False):
            idx = ids.to(head.qweight.device)
            bias = head.bias[idx] if head.bias is not None else None
            new: nn.Module = type(head)(head.qweight[idx].clone(), head.scale[idx].clone(), bias, head.act_dtype)
        elif type(head) is nn.Linear and type(head.weight) in (torch.Tensor, nn.Parameter) and head.weight.is_floating_point():
            w = head.weight
            idx = ids.to(w.device)
            new = nn.Linear(head.in_features, len(ids), bias=head.bias is not None, dtype=w.dtype, device=w.device)
            new.weight = nn.Parameter(w.detach()[idx].clone(), requires_grad=False)
            if head.bias is not None:
                new.bias = nn.Parameter(head.bias.detach()[idx].clone(), requires_grad=False)
        else:
            raise ModelLoadError(
                f"cannot slice an output layer of type {type(head).__name__} (weight {type(head.weight).__name__}) "
                "to a vocabulary subset: slice it before quantizing")
    model.set_output_embeddings(new)
    return new


def expand_logits(logits: torch.Tensor, ids: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    """Subset logits back to the full vocabulary, -inf outside the subset.

    Args:
        logits: ``[n, N]`` float, column j scoring token ``ids[j]``.
        ids: ``[N]`` int64 ascending, on ``logits``' device.
        vocab_rows: full width V.

    Returns:
        ``[n, V]`` float (``logits``' dtype and device); softmax of a row is the subset's
        distribution, exactly zero outside it.
    """
    out = logits.new_full((logits.shape[0], vocab_rows), float("-inf"))
    out[:, ids] = logits
    return out
