"""The draft-model proposer: a small causal LM drafts K tokens autoregressively.

Greedy requests draft the draft's argmax (q one-hot). Sampling requests draft from the draft's
distribution warped exactly like the target's (:func:`specdec.engine.sampling.warp_probs`) and
restricted to its ``top_m`` most likely ids (:func:`specdec.engine.sampling.restrict_support`), which is
what the block carries to the verifier (Leviathan et al. 2023, §2.3: any proposal distribution is
exact as long as the verifier uses it).

Early stop by draft confidence: with ``min_confidence > 0`` a block ends after the first drafted
token whose probability under the draft's (warped) distribution is below it, so K is an upper
bound and hard stretches of text cost fewer wasted draft and verify positions. The stop depends
only on the draft's own state, so output stays exact (greedy: the target's argmax path; sampling:
each drafted position is verified against the q it was drawn from). This is the rule of
transformers' assisted generation (``assistant_confidence_threshold``, default 0.4).

Vocabulary subset (FR-Spec, Zhao et al. 2025; :mod:`specdec.models.vocab_subset`): a draft
loaded with ``vocab_subset`` N scores only N token ids; its ``[1, N]`` logits are widened to the
full vocabulary with -inf outside the subset (:meth:`LoadedModel.full_logits`) before the
processors and warpers, so q (what the block carries) is the distribution actually sampled
from: zero outside the subset, renormalised over it. Greedy drafts are the subset's argmax. The
same code runs for :meth:`DraftModelProposer.propose_batch` and the served draft replica. Any
token can be fed (the input embedding is whole), so a target token outside the subset is fine.

Devices: the draft's logits stay on the draft's device; random draws are made on a CPU
generator (:func:`specdec.engine.sampling.step_generator`, side ``draft``), the drafted ids leave as
Python ints, and the block's tensors (``token_ids``, ``q_ids``, ``q_probs``) are always on the
CPU: a block is what goes on the wire, and the verifier moves it to the target's device.

The draft KV cache is kept across steps; after a rejection it is cut back lazily on the next
``propose`` to the prefix shared with the committed sequence (:class:`CachedSequence`), and a
session rebuilt from a token history simply starts with an empty cache.
"""

from __future__ import annotations

import time
from typing import Generator, Sequence

import torch

from specdec.engine.kv_cache import CachedSequence, _common_prefix, feed_many
from specdec.models.loaded import LoadedModel
from specdec.engine.processors import LogitProcessing
from specdec.request import SamplingParams
from specdec.engine.sampling import (
    DRAFT,
    greedy_token,
    mask_unemittable,
    restrict_support,
    sample_from,
    step_generator,
    warp_probs,
)
from specdec.types import DraftBlock

#: uncached tail of a decoding draft session after a step (the last draft, not fed, and the
#: bonus token): not counted as prefill by :meth:`DraftModelProposer.propose_batch`
DECODE_TAIL = 2

#: default support size M of the proposal distribution sent per drafted position
DEFAULT_TOP_M = 64


class DraftModelSession:
    """One sequence drafted by a draft model. See :class:`specdec.engine.proposers.base.ProposerSession`."""

    def __init__(self, proposer: "DraftModelProposer", token_ids: Sequence[int], sampling: SamplingParams, seed: int,
                 min_confidence: float = 0.0, processing: LogitProcessing | None = None, prefix_scope: str = ""):
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self._proposer = proposer
        self.sampling = sampling
        self.processing = processing if processing is not None and processing.active else None
        self.seed = seed
        self.min_confidence = float(min_confidence)
        self.seq = CachedSequence(proposer.draft.model, [int(t) for t in token_ids], device=proposer.draft.device,
                                  prefix_scope=prefix_scope)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    def behind(self) -> int:
        """Committed tokens this draft has not fed yet (its prompt before its first drafting
        step, then every token decoded at K = 0: it feeds them on its next drafting step, a
        catch-up); 0 when no more than the ``DECODE_TAIL`` positions a drafting step leaves
        uncached, or once closed."""
        if self.seq.cache is None:
            return 0
        committed, cached = self.seq.token_ids, self.seq.cached
        n = min(len(cached), len(committed))
        same = n if cached[:n] == committed[:n] else next(i for i in range(n) if cached[i] != committed[i])
        return len(committed) - same if len(committed) - same > DECODE_TAIL else 0

    def propose(self, k: int) -> DraftBlock:
        """Draft up to ``k`` tokens; fewer at an EOS, the draft's context limit, or after a
        token whose draft probability is below ``min_confidence``.

        Returns:
            A block with ``token_ids [k']`` int64 and, when sampling, ``q_ids``/``q_probs``
            ``[k', M]`` (ids below the draft's emittable vocabulary; all on the CPU);
            :meth:`DraftBlock.empty` when ``k' == 0``.
        """
        steps = self.drafting(k)
        try:
            tokens, keep = next(steps)
            while True:
                tokens, keep = steps.send(self.seq.feed(tokens, keep=keep))
        except StopIteration as done:
            return done.value

    def drafting(self, k: int) -> Generator[tuple[list[int], int], torch.Tensor, DraftBlock]:
        """The drafting of one block as a coroutine, so a driver can batch the forwards.

        :meth:`propose` drives it alone (the unbatched path, one forward per draft position);
        :meth:`DraftModelProposer.propose_batch` drives many at once. Yields ``(tokens, keep)``:
        ids to feed after ``self.seq.cached`` and how many final logits are wanted (1); is sent
        the ``[1, V]`` float32 logits back (``[1, N]`` for a vocabulary-subset draft: widened here); returns the :class:`DraftBlock` (as
        ``StopIteration.value``).
        """
        draft = self._proposer.draft
        # Drafting token j (1-based) feeds position len + j - 2: stay below the draft's limit.
        k = min(k, draft.max_positions - len(self.seq.token_ids) + 1)
        if k <= 0:
            return DraftBlock.empty()
        keep = self.seq.sync(self.seq.token_ids)
        logits = yield self.seq.token_ids[keep:], 1  # [1, V]
        generator = step_generator(self.seed, len(self.seq.token_ids), DRAFT)
        tokens: list[int] = []
        q_ids: list[torch.Tensor] = []
        q_probs: list[torch.Tensor] = []
        eos = self._proposer.eos_ids
        # Greedy drafting without processors needs only the argmax and, with early stop, its
        # probability: both taken over the draft's own row of emittable scores (a view of the first
        # emittable ids, or a vocabulary subset's [1, N] row, whose ids are all emittable and
        # ascending), without widening it to [1, V] with -inf nor the masked copy. The same token (the
        # first maximal id: -inf ids are never a unique max, and ascending subset ids keep the lowest
        # id first) and the same distribution (-inf ids have probability 0); ~0.08 ms instead of
        # ~0.33 ms per drafted token with a 65,536-id subset (one thread, AMD EPYC).
        fast_greedy = self.sampling.greedy and self.processing is None
        subset = draft.vocab_subset
        for j in range(k):
            if fast_greedy:
                row = logits[0] if subset is not None else logits[0, : draft.emittable_vocab]
                pick = int(greedy_token(row))
                token = int(subset[pick]) if subset is not None else pick
                tokens.append(token)
                if token in eos or j == k - 1:
                    break
                if self.min_confidence > 0.0 and float(torch.softmax(row.float(), dim=-1)[pick]) < self.min_confidence:
                    break  # an unsure token ends the block (it is still proposed)
                logits = yield [token], 1  # [1, V] or [1, N]
                continue
            # a vocabulary-subset draft (FR-Spec): [1, N] -> [1, V], -inf outside the subset, so q is
            # zero there and renormalised over the subset by the same processors and warpers
            logits = mask_unemittable(draft.full_logits(logits), draft.emittable_vocab)
            if self.processing is not None:  # as the target will at this position: drafts so far included
                logits = self.processing.apply(logits, self.seq.token_ids + tokens)
            if self.sampling.greedy:
                token = int(greedy_token(logits[0]))
                confident = (
                    self.min_confidence <= 0.0
                    or float(torch.softmax(logits[0].float(), dim=-1)[token]) >= self.min_confidence
                )
            else:
                ids, q = restrict_support(
                    warp_probs(logits, self.sampling), self._proposer.top_m, draft.emittable_vocab
                )  # [1, M] each, on the draft's device
                ids, q = ids[0].cpu(), q[0].cpu()  # the block goes on the wire from the CPU
                pick = sample_from(q, generator)
                token = int(ids[pick])
                q_ids.append(ids)
                q_probs.append(q)
                confident = float(q[pick]) >= self.min_confidence
            tokens.append(token)
            if token in eos or j == k - 1 or not confident:
                break  # never propose past an EOS or an unsure token; the last draft need not be fed
            logits = yield [token], 1  # [1, V]
        ids_t = torch.tensor(tokens, dtype=torch.long, device="cpu")
        if self.sampling.greedy:
            return DraftBlock(token_ids=ids_t)
        return DraftBlock(token_ids=ids_t, q_ids=torch.stack(q_ids), q_probs=torch.stack(q_probs).float())

    def commit(self, token_ids: Sequence[int]) -> None:
        self.seq.commit(token_ids)

    def close(self) -> None:
        self.seq.close()


def draft_options(spec) -> dict:
    """Keyword options of :meth:`DraftModelProposer.open_session` that a request sets.

    Only options away from their default are passed, so a draft proposer that does not know an
    option still serves the requests that do not use it (and fails loudly on those that do).

    Args:
        spec: the request's :class:`specdec.request.SpeculationParams`.
    """
    return {"min_confidence": spec.draft_min_confidence} if spec.draft_min_confidence > 0 else {}


class DraftModelProposer:
    """Drafts with a small causal LM that shares the target's vocabulary.

    Args:
        draft: the loaded draft model (checked against the target beforehand with
            :func:`specdec.models.vocab.check_pair_compatible`).
        top_m: support size M of the proposal distribution under sampling.
        eos_ids: ids after which nothing is proposed (defaults to the draft's EOS ids).
        lean: run the draft's forwards (decode steps, prefill chunks, packed batches) through
            :func:`specdec.models.lean_decode.install` (bitwise transformers' forward, fewer calls;
            a model it does not know keeps transformers' forward).
    """

    name = "draft"

    def __init__(self, draft: LoadedModel, top_m: int = DEFAULT_TOP_M, eos_ids: Sequence[int] | None = None,
                 lean: bool = True):
        if top_m < 1:
            raise ValueError(f"top_m must be >= 1, got {top_m}")
        if lean:
            from specdec.models.lean_decode import install

            install(draft.model)
        self.draft = draft
        self.top_m = top_m
        self.eos_ids = set(eos_ids if eos_ids is not None else draft.eos_token_ids)

    def open_session(self, token_ids: Sequence[int], sampling: SamplingParams, seed: int, *,
                     min_confidence: float = 0.0, processing: LogitProcessing | None = None,
                     prefix_scope: str = "") -> DraftModelSession:
        """See :meth:`specdec.engine.proposers.base.Proposer.open_session`.

        Args:
            min_confidence: end a block after a drafted token whose draft probability is below
                this (0 disables; transformers' assisted generation uses 0.4).
            processing: the request's output-dependent logit processing, applied to each drafted
                position exactly as the verifier applies it to the target's (exactness needs both).
            prefix_scope: the prefix cache scope of the session (only sessions of the same scope
                share cached prefixes; :func:`specdec.engine.prefix_cache.prefix_scope`).

        Raises:
            ValueError: ``min_confidence`` outside [0, 1].
        """
        return DraftModelSession(self, token_ids, sampling, seed, min_confidence, processing, prefix_scope)

    def propose_batch(self, sessions: Sequence[DraftModelSession], ks: Sequence[int],
                      timings: list[tuple[int, float]] | None = None, *,
                      max_prefill: int | None = None,
                      trace: list[tuple[int, int]] | None = None) -> list[DraftBlock | None]:
        """Draft for several sessions at once: one batched forward per draft position.

        Every session drafts exactly as :meth:`DraftModelSession.propose` would (its own cache,
        sampling parameters, seeded generator and early stop); the forwards of all sessions
        still drafting at a position are packed into one (:func:`specdec.kv_cache.feed_many`),
        the first one carrying each session's uncached tail (after a rejection, or a new prompt).

        Args:
            sessions: sessions of this proposer, each at most once.
            ks: the largest K per session.
            timings: when given, ``(rows, wall seconds)`` of every batched draft forward is appended.
            max_prefill: chunked draft prefill: the uncached tails longer than
                :data:`DECODE_TAIL` (a new prompt, a rebuilt history; a decoding session's tail
                is at most the last draft and the bonus token) fed in this call's first forward
                total at most this many positions.
                Sessions are taken shortest tail first; one whose tail does not fit is fed a
                chunk of what is left (cached, no logits) and gets None: it drafts in a later
                call, once its tail fits. The first session always feeds at least a chunk, so
                every call makes progress, and a long prompt delays the other sessions'
                drafting by at most ``max_prefill`` positions per call. None: no bound.
            trace: when given, ``(rows, positions)`` of every batched draft forward is appended.

        Returns:
            one :class:`DraftBlock` per session, in order; None for a session whose prompt is
            still being prefilled in chunks (only with ``max_prefill``).

        Raises:
            ValueError: lengths differ, a session appears twice, or ``max_prefill < 1``.
        """
        if max_prefill is not None and max_prefill < 1:
            raise ValueError(f"max_prefill must be >= 1, got {max_prefill}")
        if len(sessions) != len(ks):
            raise ValueError("propose_batch: one K per session")
        if len({id(s) for s in sessions}) != len(sessions):
            raise ValueError("propose_batch: a session appears twice")
        blocks: list[DraftBlock | None] = [None] * len(sessions)
        running: dict[int, tuple[Generator, tuple[list[int], int]]] = {}
        chunks: list[tuple[CachedSequence, list[int], int]] = []  # prefill chunks of this call
        budget = float("inf") if max_prefill is None else max_prefill

        def tail(i: int) -> int:
            seq = sessions[i].seq
            ids = seq.token_ids
            return len(ids) - min(_common_prefix(seq.cached, ids), len(ids) - 1)

        order0 = range(len(sessions)) if max_prefill is None else sorted(range(len(sessions)), key=tail)
        for i in order0:
            session, k = sessions[i], ks[i]
            if max_prefill is not None and k > 0:
                n = tail(i)
                if n <= DECODE_TAIL:
                    n = 0  # a decoding session's tail (last draft + bonus token) is not prefill
                elif n > budget:  # prefill a chunk of what is left; draft in a later call
                    if budget >= 1:
                        keep = session.seq.sync(session.seq.token_ids)
                        chunks.append((session.seq, session.seq.token_ids[keep:keep + int(budget)], 0))
                        budget = 0
                    continue
                budget -= n
            steps = session.drafting(k)
            try:
                running[i] = (steps, next(steps))
            except StopIteration as done:
                blocks[i] = done.value
        while running or chunks:
            order = list(running)
            feeds = [(sessions[i].seq, *running[i][1]) for i in order] + chunks
            chunks = []
            t0 = time.perf_counter()
            outs = feed_many(feeds)
            if timings is not None:
                timings.append((len(feeds), time.perf_counter() - t0))
            if trace is not None:
                trace.append((len(feeds), sum(len(tokens) for _, tokens, _ in feeds)))
            for i, logits in zip(order, outs):
                steps = running[i][0]
                try:
                    running[i] = (steps, steps.send(logits))
                except StopIteration as done:
                    blocks[i] = done.value
                    del running[i]
        return blocks  # type: ignore[return-value]
