"""The proposer interface: what drafts a candidate block for one sequence.

A *proposer* holds what is shared by all sequences (a draft model, or nothing for prompt
lookup); :meth:`Proposer.open_session` makes a *session*, the per-sequence state (token history,
draft KV cache, random generator). The decoding loop only talks to sessions:

1. ``block = session.propose(k)`` drafts up to k tokens after the session's history;
2. the target verifies the block (:class:`specdec.engine.verifier.TargetSession`);
3. ``session.commit(result.token_ids)`` appends the emitted tokens, so the session's history is
   again the committed sequence; a draft KV cache that went past the accepted prefix is cut back
   lazily, on the next ``propose``.

Policy (how large K is) stays out of proposers: K comes from the caller on every step.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from specdec.request import SamplingParams
from specdec.types import DraftBlock


@runtime_checkable
class ProposerSession(Protocol):
    """Per-sequence proposer state."""

    @property
    def token_ids(self) -> list[int]:
        """The committed sequence (prompt + generated tokens) the session drafts after."""
        ...

    def propose(self, k: int) -> DraftBlock:
        """Draft up to ``k`` tokens (``k >= 0``) after the committed sequence.

        May return fewer than ``k`` tokens (never past an EOS, no n-gram match, or a context
        limit), down to :meth:`DraftBlock.empty`. Never raises for "nothing to propose".
        """
        ...

    def commit(self, token_ids: Sequence[int]) -> None:
        """Append tokens the verifier emitted to the committed sequence."""
        ...

    def close(self) -> None:
        """Free the session's caches. Idempotent."""
        ...


class Proposer(Protocol):
    """Shared part of a proposer; makes one session per sequence."""

    #: short name used in stats and metrics: ``"draft"`` or ``"ngram"``
    name: str

    def open_session(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int) -> ProposerSession:
        """Start drafting after ``token_ids`` (the prompt, or a full history to rebuild from).

        Args:
            token_ids: committed sequence so far, ids of the shared vocabulary.
            sampling: the request's sampling parameters, applied to q exactly as to p.
            seed: seed of the session's own random generator (never shared between requests).
        """
        ...
