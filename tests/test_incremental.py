"""Per-step work of stop-string scanning and prompt lookup stays flat over a long output.

Work is counted, not timed: the Python lines executed in ``specdec/engine/stopping.py`` (or
``specdec/engine/proposers/prompt_lookup.py``) per step, traced with ``sys.settrace``, early in an
8k-token output and at its end. A scan of the whole output per step (what these replaced) makes
the late count grow with the output; the incremental code does the same work at token 8000 as
at token 500.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import specdec.engine.proposers.prompt_lookup as prompt_lookup
import specdec.engine.stopping as stopping
from specdec.engine.proposers.prompt_lookup import NgramIndex, PromptLookupProposer, find_continuation
from specdec.request import SamplingParams
from specdec.engine.stopping import OutputAssembler, TextBuffer
from specdec.testing.tiny import build_tiny_tokenizer

LENGTH = 8192


def _lines(files: set[str], fn) -> int:
    """Python lines executed inside ``files`` while ``fn()`` runs."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename not in files:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


@pytest.fixture(scope="module")
def plain_ids():
    """Ids of the tiny byte-level tokenizer that decode to letters (no partial characters)."""
    tok = build_tiny_tokenizer()
    ids = [i for i in range(3, len(tok)) if tok.decode([i]).isalpha()]
    assert len(ids) > 40
    return tok, ids


def test_stop_string_scan_per_step_is_flat_at_8k_tokens(plain_ids):
    tok, ids = plain_ids
    out = OutputAssembler(tok, max_tokens=LENGTH + 100, stop=["<never>", "###"], logprobs=True)
    files = {stopping.__file__}
    per_step: dict[int, int] = {}

    def step(i):
        block = [ids[(i * 3 + j) % len(ids)] for j in range(3)]
        out.add(block, [-0.5] * 3)
        out.take_chunk()

    i = 0
    while len(out.token_ids) < LENGTH:
        if len(out.token_ids) in range(480, 600) or len(out.token_ids) >= LENGTH - 120:
            per_step[len(out.token_ids)] = _lines(files, lambda: step(i))
        else:
            step(i)
        i += 1
    early = [n for t, n in per_step.items() if t < 1000]
    late = [n for t, n in per_step.items() if t >= 1000]
    assert len(early) == len(late) == 40
    assert max(late) <= max(early), (max(early), max(late))  # same work at 8k as at 500 tokens
    assert not out.finished and len(out.detok.text) == out.detok.text_len > LENGTH


def test_stop_string_found_at_the_end_of_8k_tokens(plain_ids):
    """The incremental scan still finds a stop string straddling two blocks, after 8k tokens."""
    tok, ids = plain_ids
    out = OutputAssembler(tok, max_tokens=LENGTH + 100, stop=["#!#"])
    i = 0
    while len(out.token_ids) < LENGTH:
        out.add([ids[i % len(ids)]])
        i += 1
    text_before, ids_before = out.detok.text, list(out.token_ids)
    hash_, bang = tok.encode("#"), tok.encode("!")
    out.add(hash_ + bang)
    out.add(hash_ + [ids[0]])
    assert out.finish_reason.value == "stop_string"
    assert out.text == text_before
    assert out.token_ids == ids_before and len(out.token_ids) == LENGTH


def test_text_buffer_tail_and_text():
    b = TextBuffer()
    for piece in ["ab", "", "cde", "f", "ghij"]:
        b.append(piece)
    assert len(b) == 10 and b.tail(0) == "abcdefghij" and b.tail(3) == "defghij" and b.tail(4, 7) == "efg"
    assert b.text() == "abcdefghij"
    b.append("k")
    assert b.tail(8) == "ijk" and b.tail(11) == "" and b.text() == "abcdefghijk"


def _sequence(n: int) -> list[int]:
    """A copy-heavy sequence: a 97-token pattern repeated with a change every 50 tokens."""
    return [(i % 97) * 3 + (7 if i % 50 == 0 else 0) for i in range(n)]


def test_prompt_lookup_per_step_is_flat_at_8k_tokens():
    seq = _sequence(LENGTH + 400)
    session = PromptLookupProposer(1, 3).open_session(seq[:64], SamplingParams(), seed=0)
    files = {prompt_lookup.__file__}
    early, late = [], []
    pos = 64
    while pos < LENGTH:
        def step():
            session.propose(4)
            session.commit(seq[pos : pos + 4])
        if 480 <= pos < 640:
            early.append(_lines(files, step))
        elif pos >= LENGTH - 160:
            late.append(_lines(files, step))
        else:
            step()
        pos += 4
    assert len(early) == len(late) == 40
    assert max(late) <= max(early), (max(early), max(late))
    # the index's own counter: tokens touched per step, bounded by the n-gram sizes and K
    before = session.index.work
    session.propose(16)
    assert session.index.work - before <= 3 + 2 + 1 + 16


@pytest.mark.parametrize("seed", range(5))
def test_index_gives_the_full_scan_answer(seed):
    import random

    rng = random.Random(seed)
    seq = [rng.randrange(6) for _ in range(300)]
    index = NgramIndex(1, 3, seq[:2], {5})
    for i in range(2, len(seq)):
        for k in (1, 4, 16):
            assert index.continuation(k, {5}) == find_continuation(seq[:i], k, 1, 3, {5})
        index.extend([seq[i]])
    two = NgramIndex(2, 2, seq)
    assert two.continuation(8) == find_continuation(seq, 8, 2, 2)
