"""The draft/target vocabulary check (specdec.models.vocab) on tiny models, and SmolLM2 vs Qwen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from specdec.errors import ModelCompatibilityError
from specdec.models.loader import load_model
from specdec.models.spec import GGUFModelSpec, HFModelSpec
from specdec.models.vocab import VocabSide, check_pair_compatible, check_vocab_compatible
from specdec.testing.tiny import build_tiny_model, build_tiny_tokenizer


def _load(folder: Path):
    return load_model(HFModelSpec(path=folder))


def _swapped_tokenizer(i: int, j: int) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the tokens at ids i and j exchanged (merges stay valid)."""
    base = build_tiny_tokenizer()
    data = json.loads(base.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    by_id = {v: k for k, v in vocab.items()}
    vocab[by_id[i]], vocab[by_id[j]] = j, i
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        eos_token=base.eos_token, pad_token=base.pad_token, clean_up_tokenization_spaces=False,
    )
    return tok


def _with_added(token: str) -> PreTrainedTokenizerFast:
    tok = build_tiny_tokenizer()
    tok.add_tokens([token])
    return tok


def test_same_tiny_model_is_compatible(tiny_model_folder):
    m = _load(tiny_model_folder)
    check_pair_compatible(m, m)


@pytest.mark.parametrize("padded", ["target", "draft"])
def test_padded_embedding_rows_are_fine(tmp_path, padded):
    # 320 tokenizer ids; one side's embedding matrix padded to 400 rows, like 151936 vs 152064.
    rows = {"target": None, "draft": None, padded: 400}
    target = _load(build_tiny_model(tmp_path / "t", seed=0, vocab_rows=rows["target"]))
    draft = _load(build_tiny_model(tmp_path / "d", seed=1, vocab_rows=rows["draft"]))
    assert (target.vocab_rows, draft.vocab_rows)[padded == "draft"] == 400
    assert target.emittable_vocab == draft.emittable_vocab == 320
    check_pair_compatible(draft, target)


def test_draft_with_fewer_emittable_ids_is_fine(tmp_path):
    # The draft's logits cover only ids 0..299: every id it can emit means the same in the target.
    target = _load(build_tiny_model(tmp_path / "t", seed=0))
    draft = _load(build_tiny_model(tmp_path / "d", seed=1))
    check_vocab_compatible(VocabSide(draft.name, draft.tokenizer, 300, (2,)), VocabSide.of(target))


def test_different_eos_id(tmp_path):
    tok = build_tiny_tokenizer()
    tok.eos_token = "<|im_start|>"  # id 1 instead of <|im_end|> (id 2)
    draft_dir = build_tiny_model(tmp_path / "d", tokenizer=tok)
    target_dir = build_tiny_model(tmp_path / "t")
    with pytest.raises(ModelCompatibilityError) as e:
        check_pair_compatible(_load(draft_dir), _load(target_dir))
    assert str(e.value) == (
        f"draft {str(draft_dir)!r} and target {str(target_dir)!r} are incompatible: "
        "EOS id differs: draft 1, target 2"
    )


def test_different_pad_id(tmp_path):
    draft, target = _load(build_tiny_model(tmp_path / "d")), _load(build_tiny_model(tmp_path / "t"))
    side = VocabSide.of(draft)
    side.tokenizer.pad_token = "<|im_start|>"
    with pytest.raises(ModelCompatibilityError, match=r"PAD id differs: draft 1, target 0$"):
        check_vocab_compatible(side, VocabSide.of(target))


def test_swapped_tokens(tmp_path):
    draft_dir = build_tiny_model(tmp_path / "d", tokenizer=_swapped_tokenizer(300, 301))
    target_dir = build_tiny_model(tmp_path / "t")
    draft, target = _load(draft_dir), _load(target_dir)
    t300 = target.tokenizer.convert_ids_to_tokens(300)
    t301 = target.tokenizer.convert_ids_to_tokens(301)
    with pytest.raises(ModelCompatibilityError) as e:
        check_pair_compatible(draft, target)
    assert str(e.value) == (
        f"draft {str(draft_dir)!r} and target {str(target_dir)!r} use different vocabularies: "
        f"id 300 is {t301!r} in the draft but {t300!r} in the target (the target has {t301!r} at id 301)"
    )


def test_token_the_target_lacks(tmp_path):
    draft_dir = build_tiny_model(tmp_path / "d", tokenizer=_with_added("abc"))  # id 320
    target_dir = build_tiny_model(tmp_path / "t", tokenizer=_with_added("xyz"))
    with pytest.raises(ModelCompatibilityError) as e:
        check_pair_compatible(_load(draft_dir), _load(target_dir))
    assert str(e.value) == (
        f"draft {str(draft_dir)!r} and target {str(target_dir)!r} use different vocabularies: "
        "id 320 is 'abc' in the draft but 'xyz' in the target (the target has no token 'abc')"
    )


def test_draft_emits_ids_beyond_target(tmp_path):
    draft_dir = build_tiny_model(tmp_path / "d", tokenizer=_with_added("abc"))  # 321 ids
    target_dir = build_tiny_model(tmp_path / "t", vocab_rows=400)  # 320 ids, 400 rows
    with pytest.raises(ModelCompatibilityError) as e:
        check_pair_compatible(_load(draft_dir), _load(target_dir))
    assert str(e.value) == (
        f"draft {str(draft_dir)!r} and target {str(target_dir)!r} use different vocabularies: "
        "the draft can emit ids up to 320 (id 320 is 'abc') but the target only ids below 320"
    )


SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.mark.demo
def test_smollm2_draft_against_qwen_target(demo_pair, smollm2_gguf):
    target, _ = demo_pair
    path = smollm2_gguf
    smol = load_model(GGUFModelSpec(path=path))
    assert smol.vocab_rows == 49152 and smol.eos_token_ids == [2]
    with pytest.raises(ModelCompatibilityError) as e:
        check_pair_compatible(smol, target)
    # SmolLM2 starts with its special tokens, Qwen with the byte-level alphabet.
    assert str(e.value) == (
        "draft 'SmolLM2-135M-Instruct.Q4_1.gguf' and target 'demo target (Qwen2.5-Coder-1.5B-Instruct)' "
        "use different vocabularies: id 0 is '<|endoftext|>' in the draft but '!' in the target "
        "(the target has '<|endoftext|>' at id 151643)"
    )
