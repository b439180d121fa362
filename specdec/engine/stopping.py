"""Turning emitted tokens into output: incremental text, stop conditions, safe streaming.

Stop conditions are checked token by token, in this order for each token: EOS, a stop token
id, a stop string, ``max_tokens``. The first to fire ends the generation at that token, also in
the middle of an accepted block.

- EOS / stop token id: the id is the last of ``token_ids`` (and counted in usage); its text is
  not added to ``text``.
- Stop string: ``text`` ends just before the earliest-completing match (stop string excluded;
  when two complete at the same token, the one that ends first in the text wins, then the one
  that starts first). ``token_ids`` (and logprobs) keep exactly the tokens whose text lies
  entirely before the match; a token straddling the match start is dropped with it.
- ``max_tokens``: at most that many ids are ever returned.

Streaming holds back text that could still become a stop string (a suffix that is a prefix of
one) and tokens whose text is not complete yet (a partial UTF-8 character), so nothing after a
stop is ever sent and the chunks concatenate to the unary result.

Cost: every step reads only what is new (the text since the last check, plus the longest stop
string's length before it; the tokens not yet sent): the work per token is constant, not
proportional to the output so far (``tests/test_incremental.py`` counts it at 8k tokens).
"""

from __future__ import annotations

import bisect
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from specdec.types import FinishReason, GenerationChunk


class TextBuffer:
    """Append-only text whose end can be read at a cost proportional to the part read.

    ``str += str`` on an attribute copies the whole text each time (quadratic over a long
    output); the buffer keeps the appended pieces and joins only what is asked for.
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._ends: list[int] = []  # cumulative length after each part
        self._len = 0
        self._joined: str | None = ""

    def __len__(self) -> int:
        return self._len

    def append(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)
            self._len += len(piece)
            self._ends.append(self._len)
            self._joined = None

    def tail(self, start: int, end: int | None = None) -> str:
        """``text[start:end]`` (``end`` defaults to the end); costs O(len(text) - start + log n)."""
        start = max(0, start)
        end = self._len if end is None else min(end, self._len)
        if start >= end:
            return ""
        if self._joined is not None:
            return self._joined[start:end]
        i = bisect.bisect_right(self._ends, start)  # first part ending after ``start``
        first = self._ends[i] - len(self._parts[i])
        return "".join(self._parts[i:])[start - first : end - first]

    def text(self) -> str:
        """The whole text (joined once, then cached until the next append)."""
        if self._joined is None:
            self._joined = "".join(self._parts)
            self._parts, self._ends = [self._joined], [self._len]
        return self._joined


class IncrementalDetokenizer:
    """Decodes a growing list of ids into text, one token at a time, at constant cost per token.

    Uses a prefix window (as vLLM's ``detokenize_incrementally``): the text of new tokens is the
    difference between decoding ``ids[prefix:]`` and ``ids[prefix:read]``, which keeps
    tokenizers that drop a leading space at the start of a decode correct, and waits while the
    text ends in an incomplete character (U+FFFD). Special tokens (``<|endoftext|>``, ...) decode
    to no text, as with vLLM's default ``skip_special_tokens=True``; their ids stay in ``ids``.
    Only the pending tokens' offsets are touched when text resolves, so the work per token does
    not grow with the output.

    Attributes:
        text: decoded text of the tokens read so far (joined on access; use :meth:`tail` in
            per-step code).
        offsets: ``offsets[i]`` = ``len(text)`` once token i's text is complete, or None while
            pending; the resolved offsets are a non-decreasing prefix of the list.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.offsets: list[int | None] = []
        self._text = TextBuffer()
        self._resolved = 0  # offsets[:_resolved] are set, the rest are None
        self._prefix = 0
        self._read = 0

    @property
    def text(self) -> str:
        return self._text.text()

    @property
    def text_len(self) -> int:
        """``len(text)`` without joining it."""
        return len(self._text)

    @property
    def resolved(self) -> int:
        """How many leading tokens have their text complete (``offsets[:resolved]`` are set)."""
        return self._resolved

    def tail(self, start: int, end: int | None = None) -> str:
        """``text[start:end]`` at a cost proportional to its length."""
        return self._text.tail(start, end)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int, final: bool = False) -> None:
        """Append one id; resolve pending text when complete (or when ``final``)."""
        self.ids.append(int(token_id))
        self.offsets.append(None)
        self._advance(final)

    def flush(self) -> None:
        """Force out pending text (end of generation), U+FFFD included if it is incomplete."""
        if self._read < len(self.ids):
            self._advance(final=True)

    def _advance(self, final: bool) -> None:
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._text.append(new_text[len(prefix_text) :])
            self._prefix, self._read = self._read, len(self.ids)
            self._resolve()
        elif final or (len(new_text) == len(prefix_text) and not new_text.endswith("\ufffd")):
            # final, or the new tokens decode to nothing (special tokens, skipped): their text
            # ends here, not after the next token's
            self._resolve()

    def _resolve(self) -> None:
        end = len(self._text)
        for i in range(self._resolved, len(self.offsets)):
            self.offsets[i] = end
        self._resolved = len(self.offsets)


class OutputAssembler:
    """Accumulates emitted tokens, applies stop conditions, and yields safe chunks.

    Args:
        tokenizer: the target's tokenizer.
        max_tokens: most completion tokens (>= 1).
        eos_ids: ids that end the generation with ``FinishReason.EOS`` (empty when the request
            ignores EOS).
        stop_token_ids: ids that end it with ``FinishReason.STOP_TOKEN``.
        stop: stop strings (non-empty).
        logprobs: whether logprobs are collected.
        top_logprobs: with logprobs, also keep each token's N most likely alternatives (N > 0).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_tokens: int,
        eos_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        logprobs: bool = False,
        top_logprobs: int = 0,
    ):
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_tokens = max_tokens
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids) - self.eos_ids
        self.stop = [s for s in stop]
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.want_logprobs = logprobs
        self.detok = IncrementalDetokenizer(tokenizer)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.want_top = bool(logprobs and top_logprobs)
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: FinishReason | None = None
        self._text_end: int | None = None  # text cut (stop string) once finished
        self._sent_text = 0
        self._sent_ids = 0
        self._checked_upto = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The output text so far (final once finished). Joins the whole text: not per step."""
        return self.detok.text if self._text_end is None else self.detok.tail(0, self._text_end)

    @property
    def _text_len(self) -> int:
        return self.detok.text_len if self._text_end is None else min(self._text_end, self.detok.text_len)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None,
            top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None) -> FinishReason | None:
        """Add the tokens of one verified block, token by token, until a stop condition fires.

        Returns:
            The finish reason if the generation ended within this block, else None. Tokens after
            the stopping one are ignored.
        """
        for i, tok in enumerate(token_ids):
            if self.finished:
                break
            tok = int(tok)
            self.token_ids.append(tok)
            if self.want_logprobs:
                self.logprobs.append(float(logprobs[i]) if logprobs is not None else float("nan"))
            if self.want_top:
                self.top_logprobs.append(list(top_logprobs[i]) if top_logprobs is not None else [])
            if tok in self.eos_ids:
                self._finish(FinishReason.EOS)
            elif tok in self.stop_token_ids:
                self._finish(FinishReason.STOP_TOKEN)
            else:
                self.detok.add(tok, final=len(self.token_ids) >= self.max_tokens)
                if self.stop and self._check_stop_strings():
                    break
                if len(self.token_ids) >= self.max_tokens:
                    self._finish(FinishReason.MAX_TOKENS)
        return self.finish_reason

    @property
    def sent_ids(self) -> int:
        """How many of ``token_ids`` the chunks taken so far carried."""
        return self._sent_ids

    @property
    def sent_text_chars(self) -> int:
        """How many characters of text the chunks taken so far carried."""
        return self._sent_text

    def mark_sent(self, ids: int, text_chars: int) -> None:
        """Record that the first ``ids`` tokens and ``text_chars`` characters were already
        streamed (by an earlier run of a resumed generation): the next chunk starts after them.

        ``text_chars`` may run ahead of the text of those ids (the text of a held-back token
        may be partly sent) and of the text so far (then the next chunks start there).

        Raises:
            ValueError: more ids than were added, or negative counts.
        """
        if not 0 <= ids <= len(self.token_ids) or text_chars < 0:
            raise ValueError(f"cannot mark {ids} ids / {text_chars} characters sent of {len(self.token_ids)} ids")
        self._sent_ids = max(self._sent_ids, ids)
        self._sent_text = max(self._sent_text, text_chars)

    def finish(self, reason: FinishReason) -> None:
        """End the generation for a reason outside the tokens (context limit, cancellation)."""
        if not self.finished:
            self._finish(reason)

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        # The EOS / stop id itself was never given to the detokenizer: its text is not output.
        self.detok.flush()
        if self.stop:
            self._check_stop_strings()

    def _check_stop_strings(self) -> bool:
        # Only text that can hold a match not seen before: from max_stop - 1 characters before
        # the previous check's end (a match completing now may start there).
        start = max(0, self._checked_upto - self._max_stop + 1)
        window = self.detok.tail(start)
        best: tuple[int, int] | None = None  # (match end, match start), in text offsets
        for s in self.stop:
            idx = window.find(s)
            if idx >= 0:
                cand = (start + idx + len(s), start + idx)
                if best is None or cand < best:
                    best = cand
        self._checked_upto = start + len(window)
        if best is None:
            return False
        cut = best[1]
        self._text_end = cut
        # tokens entirely before the match: the resolved offsets are non-decreasing
        keep = bisect.bisect_right(self.detok.offsets, cut, 0, self.detok.resolved)
        # A token that completed the match on its own still counts as generated; ids keep only
        # tokens entirely before the stop string.
        del self.token_ids[keep:]
        if self.want_logprobs:
            del self.logprobs[keep:]
            del self.top_logprobs[keep:]
        self.finish_reason = FinishReason.STOP_STRING
        return True

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def take_chunk(self) -> GenerationChunk | None:
        """The text and ids that are safe to send now, or None when there is nothing new.

        After the generation finished, the last call returns the rest with ``finish_reason`` set.
        Reads only what was not sent yet (``safe`` never moves back, so neither do the ids).
        """
        text_len = self._text_len
        if self.finished:
            safe = text_len
            n_ids = len(self.token_ids)
        else:
            hold = max(0, self._max_stop - 1)
            safe = text_len - self._holdback(self.detok.tail(text_len - hold, text_len))
            n_ids = self._sent_ids
            offsets, limit = self.detok.offsets, min(len(self.token_ids), self.detok.resolved)
            while n_ids < limit and offsets[n_ids] <= safe:
                n_ids += 1
        if safe < self._sent_text:
            safe = self._sent_text
        new_text = self.detok.tail(self._sent_text, safe)
        new_ids = self.token_ids[self._sent_ids : n_ids] if n_ids > self._sent_ids else []
        new_lp = self.logprobs[self._sent_ids : n_ids] if (self.want_logprobs and n_ids > self._sent_ids) else None
        if not new_text and not new_ids and not self.finished:
            return None
        if self.finished and self._sent_text >= text_len and self._sent_ids >= len(self.token_ids) and self._done_sent:
            return None
        self._sent_text = max(self._sent_text, safe)
        self._sent_ids_before = self._sent_ids
        self._sent_ids = max(self._sent_ids, n_ids)
        chunk = GenerationChunk(
            text=new_text,
            token_ids=list(new_ids),
            logprobs=(list(new_lp) if new_lp is not None else ([] if self.want_logprobs else None)),
            finish_reason=self.finish_reason,
            top_logprobs=self.top_logprobs[self._sent_ids_before : self._sent_ids] if self.want_top else None,
        )
        if self.finished:
            self._done_sent = True
        return chunk

    _done_sent = False
    _sent_ids_before = 0
