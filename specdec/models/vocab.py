"""Can this draft propose tokens for this target? The start-up vocabulary check.

Speculative decoding compares draft and target token by token, so both must agree on what every
id the draft can emit means. :func:`check_pair_compatible` requires:

1. the same token string at every id below ``draft.emittable_vocab``, and every such id below
   ``target.emittable_vocab`` (the engine samples only below ``emittable_vocab``, so embedding
   matrices padded to different sizes, e.g. 151936 vs 152064 rows, are fine);
2. the same end-of-sequence ids (tokenizer EOS plus generation-config EOS, as a set), and the
   same BOS and pad ids.

The vocabulary is checked first: when it differs, the special ids usually differ as a
consequence and the first differing token explains more. The check works on plain
tokenizer data (:class:`VocabSide`), so it can run without model weights; it compares
``get_vocab()`` lists in C where they agree and walks them in Python only to name the first
difference (about 0.1 s for the 151,936-token Qwen vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from specdec.errors import ModelCompatibilityError
from specdec.models.loaded import LoadedModel


@dataclass(frozen=True)
class VocabSide:
    """What the check needs of one model: its tokenizer, logits width and special ids.

    Attributes:
        name: human-readable model name, used in the error message.
        tokenizer: the model's tokenizer.
        vocab_rows: rows of the output embedding (logits width).
        eos_token_ids: every id that ends a generation (see :attr:`LoadedModel.eos_token_ids`).
    """

    name: str
    tokenizer: PreTrainedTokenizerBase
    vocab_rows: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, model: LoadedModel) -> "VocabSide":
        return cls(model.name, model.tokenizer, model.vocab_rows, tuple(model.eos_token_ids))

    @property
    def emittable_vocab(self) -> int:
        """Ids below this bound may be proposed or emitted: ``min(len(tokenizer), vocab_rows)``."""
        return min(len(self.tokenizer), self.vocab_rows)

    def id_to_token(self) -> list[str | None]:
        """``[len(tokenizer)]`` list: the token string of each id (None for an unused id)."""
        vocab = self.tokenizer.get_vocab()
        out: list[str | None] = [None] * max(len(self.tokenizer), max(vocab.values(), default=-1) + 1)
        for tok, i in vocab.items():
            out[i] = tok
        return out


#: The files a Hugging Face tokenizer is read from (those a folder has).
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")


def same_tokenizer_files(a: str | Path, b: str | Path) -> bool:
    """Whether folders ``a`` and ``b`` hold the same tokenizer: each file of :data:`TOKENIZER_FILES`
    present in either is present in both with the same bytes, and there is at least one (the demo
    pair's draft and target share Qwen2.5's tokenizer; one loaded copy can serve both).
    A missing folder gives False."""
    a, b = Path(a), Path(b)
    present = [n for n in TOKENIZER_FILES if (a / n).is_file() or (b / n).is_file()]
    if not present:
        return False
    try:
        return all((a / n).read_bytes() == (b / n).read_bytes() for n in present)
    except OSError:
        return False


def check_pair_compatible(draft: LoadedModel, target: LoadedModel) -> None:
    """Raise unless ``draft`` can propose tokens for ``target`` (rules in the module docstring).

    Raises:
        ModelCompatibilityError: naming both models and the first differing token or id.
    """
    check_vocab_compatible(VocabSide.of(draft), VocabSide.of(target))


def check_vocab_compatible(draft: VocabSide, target: VocabSide) -> None:
    """:func:`check_pair_compatible` on tokenizer data only (no weights needed).

    Raises:
        ModelCompatibilityError: naming both models and the first differing token or id.
    """
    problem = _vocab_difference(draft, target) or _special_difference(draft, target)
    if problem:
        raise ModelCompatibilityError(f"draft {draft.name!r} and target {target.name!r} {problem}")


def _vocab_difference(draft: VocabSide, target: VocabSide) -> str | None:
    d_tokens, t_tokens = draft.id_to_token(), target.id_to_token()
    n_draft, n_target = draft.emittable_vocab, target.emittable_vocab
    n = min(n_draft, n_target)
    if d_tokens[:n] != t_tokens[:n]:  # C-speed comparison; the loop below only finds where
        i = next(i for i in range(n) if d_tokens[i] != t_tokens[i])
        d_tok, t_tok = d_tokens[i], t_tokens[i]
        where = ""
        if d_tok is not None:
            j = target.tokenizer.get_vocab().get(d_tok)
            where = (f" (the target has no token {d_tok!r})" if j is None
                     else f" (the target has {d_tok!r} at id {j})")
        return (f"use different vocabularies: id {i} is {_show(d_tok)} in the draft but "
                f"{_show(t_tok)} in the target{where}")
    if n_draft > n_target:
        return (f"use different vocabularies: the draft can emit ids up to {n_draft - 1} "
                f"(id {n_target} is {_show(d_tokens[n_target])}) but the target only ids below {n_target}")
    return None


def _special_difference(draft: VocabSide, target: VocabSide) -> str | None:
    d_eos, t_eos = sorted(set(draft.eos_token_ids)), sorted(set(target.eos_token_ids))
    if d_eos != t_eos:
        if len(d_eos) == 1 and len(t_eos) == 1:
            return f"are incompatible: EOS id differs: draft {d_eos[0]}, target {t_eos[0]}"
        return f"are incompatible: EOS ids differ: draft {d_eos}, target {t_eos}"
    for what in ("bos", "pad"):
        d_id = getattr(draft.tokenizer, f"{what}_token_id")
        t_id = getattr(target.tokenizer, f"{what}_token_id")
        if d_id != t_id:
            return f"are incompatible: {what.upper()} id differs: draft {d_id}, target {t_id}"
    return None


def _show(token: str | None) -> str:
    return "unused" if token is None else repr(token)
