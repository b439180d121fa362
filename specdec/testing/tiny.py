"""Tiny models built from a config, for fast tests and examples.

A tiny Qwen2 causal LM (2 layers, hidden size 64) with fixed random weights and a small
byte-level BPE tokenizer trained on a fixed corpus, written to a Hugging Face-format folder
(``config.json``, ``model.safetensors``, tokenizer files) so that tests load it through the same
code path as a real model. Building one takes well under a second.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    '{"name": "specdec", "version": 1, "tags": ["fast", "exact"]}\n',
    "SELECT id, name FROM users WHERE active = 1 ORDER BY name;\n",
    "The quick brown fox jumps over the lazy dog. A poem about the sea and the sky.\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(vocab_size: int = 320, kind: str = "bytelevel") -> PreTrainedTokenizerFast:
    """Train a BPE tokenizer of ``vocab_size`` tokens on a fixed corpus.

    Deterministic: the same arguments give the same token-to-id mapping. Special tokens
    ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (id 1) and ``<|im_end|>`` (EOS, id 2).

    Args:
        vocab_size: tokens in the vocabulary.
        kind: ``"bytelevel"`` (GPT-2/Qwen style: every byte is a token, so random ids decode to
            arbitrary bytes) or ``"text"`` (SentencePiece style with ``▁`` for spaces, characters of
            the corpus only: every token decodes to printable text; adds ``<unk>`` at id 3).
    """
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind == "text":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        specials = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN, "<unk>"]
        alphabet = []
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, clean_up_tokenization_spaces=False
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def build_tiny_model(
    folder: str | Path,
    *,
    seed: int = 0,
    vocab_rows: int | None = None,
    num_layers: int = 2,
    hidden_size: int = 64,
    max_positions: int = 256,
    init_scale: float = 0.5,
    base: Qwen2ForCausalLM | None = None,
    noise: float = 0.0,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write a tiny Qwen2 causal LM and its tokenizer to ``folder`` and return the folder.

    Args:
        folder: output folder (created).
        seed: seed of the random weights.
        vocab_rows: rows of the embedding matrices (defaults to the tokenizer's size); a larger
            value pads the matrices like real checkpoints do.
        num_layers, hidden_size: model size.
        max_positions: ``max_position_embeddings``, the context limit in tokens.
        init_scale: std of the normal initialisation; larger values make peakier, more
            repetitive next-token distributions.
        base: when given, start from a copy of this model's weights (same shapes required) and
            add ``noise`` * N(0, 1) to every weight: a draft that mostly agrees with ``base``.
        noise: see ``base``.
        tokenizer: tokenizer to save; defaults to :func:`build_tiny_tokenizer`.

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or build_tiny_tokenizer()
    rows = vocab_rows or len(tokenizer)
    config = Qwen2Config(
        vocab_size=rows,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=init_scale,
    )
    gen = torch.Generator().manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if base is not None:
                src = dict(base.named_parameters())[name]
                p.copy_(src.detach().cpu() + noise * torch.randn(p.shape, generator=gen))  # base may be on a GPU
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_scale)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
