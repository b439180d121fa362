"""The verifier: the target scores a candidate block in one forward pass and decides.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then emit the
target's argmax at the first disagreement (or after the last draft: the bonus token). The
output is token for token what greedy decoding of the target alone gives.

Sampling: modified rejection sampling (Leviathan et al. 2023, §2.3 and Algorithm 1; Chen et al.
2023, Algorithm 2). Notation follows the papers: p = target distribution, q = proposal
distribution. Draft token x at position i is accepted with probability min(1, p_i(x) / q_i(x));
at the first rejection a token is drawn from norm(max(0, p_i - q_i)); if all K are accepted a
bonus token is drawn from p_{K}. The emitted tokens are distributed exactly as sampling the
target alone.

Devices: the target's logits and everything computed from them stay on the target's device
(``LoadedModel.device``); a block arrives on the CPU (it comes off the wire) and is moved there
once; random draws are made on a CPU generator (:func:`specdec.engine.sampling.step_generator`), a
distribution is copied to the CPU only for the one token drawn from it. Token ids leave as
Python ints. So the same code runs on CPU and CUDA, and a seeded request's draws do not depend
on the device.

Validation: every block is checked on arrival (:func:`validate_block`) before any tensor work,
so a malformed block from the wire is an :class:`~specdec.errors.InvalidRequestError` with a
message naming what is wrong (INVALID_ARGUMENT over gRPC), never an internal error or a
silently wrong sample.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.errors import InvalidBlockError, InvalidRequestError
from specdec.engine.kv_cache import CachedSequence, feed_many
from specdec.models.loaded import LoadedModel
from specdec.engine.processors import LogitProcessing
from specdec.request import SamplingParams
from specdec.engine.sampling import TARGET, greedy_token, mask_unemittable, sample_from, step_generator, uniform, warp_probs
from specdec.types import DraftBlock, VerifyResult

#: Largest |sum(q_probs row) - 1| accepted in a block (float32 sums of up to a few hundred terms).
Q_SUM_TOLERANCE = 1e-3


def validate_block(block: DraftBlock, emittable: int) -> None:
    """Check a candidate block before it is scored.

    Checks: drafted ids and q's ids in ``0..emittable-1``; q's probabilities finite and
    non-negative, each row summing to 1 within :data:`Q_SUM_TOLERANCE`; each drafted token has
    positive probability under its own row of q (it was drawn from q). Shapes are checked by
    :class:`~specdec.types.DraftBlock` itself.

    Args:
        block: the block (tensors on any device).
        emittable: the target's emittable vocabulary size (ids below it may be emitted).

    Raises:
        InvalidBlockError: naming the first problem found (field, position, value).
    """
    k = block.k
    if k == 0:
        return
    ids = block.token_ids
    if ids.dtype not in (torch.int64, torch.int32):
        raise InvalidBlockError(f"block token_ids must be integer ids, got {ids.dtype}")
    bad = ((ids < 0) | (ids >= emittable)).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise InvalidBlockError(f"block token_ids[{j}] = {int(ids[j])} is outside the vocabulary 0..{emittable - 1}")
    if block.q_ids is None:
        return
    q_ids, q_probs = block.q_ids, block.q_probs
    if not q_probs.is_floating_point():
        raise InvalidBlockError(f"block q_probs must be floating point, got {q_probs.dtype}")
    bad = ((q_ids < 0) | (q_ids >= emittable)).nonzero()
    if bad.numel():
        j, m = int(bad[0, 0]), int(bad[0, 1])
        raise InvalidBlockError(
            f"block q_ids[{j}][{m}] = {int(q_ids[j, m])} is outside the vocabulary 0..{emittable - 1}"
        )
    probs = q_probs.double()
    bad = (~torch.isfinite(probs)).nonzero()
    if bad.numel():
        j, m = int(bad[0, 0]), int(bad[0, 1])
        raise InvalidBlockError(f"block q_probs[{j}][{m}] = {float(probs[j, m]):.6g} is not finite")
    bad = (probs < 0).nonzero()
    if bad.numel():
        j, m = int(bad[0, 0]), int(bad[0, 1])
        raise InvalidBlockError(f"block q_probs[{j}][{m}] = {float(probs[j, m]):.6g} is negative")
    sums = probs.sum(dim=-1)  # [K]
    bad = ((sums - 1.0).abs() > Q_SUM_TOLERANCE).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise InvalidBlockError(
            f"block q_probs row {j} sums to {float(sums[j]):.6g}, not 1 (tolerance {Q_SUM_TOLERANCE:g})"
        )
    drawn = ((q_ids == ids.to(q_ids.device).unsqueeze(-1)) & (probs > 0)).any(dim=-1)  # [K]
    bad = (~drawn).nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        raise InvalidBlockError(
            f"block token_ids[{j}] = {int(ids[j])} has probability 0 under its proposal distribution q_probs[{j}]"
        )


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """Greedy verification of one block.

    Args:
        draft_ids: ``[K]`` int64 proposed tokens, on any device.
        target_logits: ``[K + 1, V]`` float, the target's logits at the positions that predict
            each draft token and the one after the last (on the target's device).

    Returns:
        ``(n, tokens)``: n accepted drafts (0..K) and the n + 1 emitted token ids.
    """
    k = int(draft_ids.shape[0])
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [K+1={k + 1}, V], got {tuple(target_logits.shape)}")
    choice = greedy_token(target_logits)  # [K+1] int64, on the logits' device
    match = (choice[:k] == draft_ids.to(choice.device)).long()
    n = int(match.cumprod(dim=0).sum()) if k else 0
    return n, draft_ids[:n].tolist() + [int(choice[n])]


def _dense_q(
    q_ids: torch.Tensor | None,
    q_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    vocab: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Scatter a sparse proposal distribution into ``[K, V]`` float32 on ``device`` (one-hot at
    ``draft_ids`` when q is None). The inputs may be on any device; they are moved to ``device``."""
    k = int(draft_ids.shape[0])
    dense = torch.zeros(k, vocab, dtype=torch.float32, device=device)
    if q_ids is None:
        rows = torch.arange(k, device=device)
        dense[rows, draft_ids.to(device)] = 1.0
    else:
        dense.scatter_add_(1, q_ids.to(device), q_probs.to(device, torch.float32))
    return dense


def rejection_sample(
    draft_ids: torch.Tensor,
    q_ids: torch.Tensor | None,
    q_probs: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, list[int]]:
    """Modified rejection sampling of one block (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft_ids: ``[K]`` int64 drafts, sampled from q (any device).
        q_ids: ``[K, M]`` int64 support of q, or None for a deterministic (one-hot) proposal.
        q_probs: ``[K, M]`` float32 q over ``q_ids``.
        p: ``[K + 1, V]`` float32 target distributions (already warped like q), on the target's
            device; q is built on the same device.
        generator: the step's CPU generator (:func:`specdec.engine.sampling.step_generator`); every
            draw is made on it (:func:`specdec.engine.sampling.uniform`, :func:`specdec.engine.sampling.sample_from`).

    Returns:
        ``(n, tokens)``: n accepted drafts and the n + 1 emitted token ids.
    """
    k = int(draft_ids.shape[0])
    vocab = p.shape[-1]
    q = _dense_q(q_ids, q_probs, draft_ids, vocab, device=p.device)  # [K, V] float32
    for i in range(k):
        x = int(draft_ids[i])
        p_x, q_x = float(p[i, x]), float(q[i, x])
        u = uniform(generator)
        if q_x > 0 and u * q_x < p_x:  # u < p_x / q_x, without dividing
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        # p == q exactly (rejection had probability 0): fall back to p itself.
        dist = residual / total if total > 0 else p[i]
        token = sample_from(dist, generator)
        return i, draft_ids[:i].tolist() + [token]
    bonus = sample_from(p[k], generator)
    return k, draft_ids.tolist() + [bonus]


class TargetSession:
    """Per-sequence target state: committed tokens, KV cache, sampling parameters, generator.

    Sessions are independent; :meth:`TargetVerifier.verify_batch` verifies several of them in
    one forward pass over their own caches.
    """

    def __init__(
        self,
        verifier: "TargetVerifier",
        token_ids: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        logprobs: bool,
        processing: LogitProcessing | None = None,
        top_logprobs: int = 0,
        prefix_scope: str = "",
    ):
        self._verifier = verifier
        self.sampling = sampling
        self.want_logprobs = logprobs
        self.seed = seed
        self.processing = processing if processing is not None and processing.active else None
        self.top_logprobs = int(top_logprobs) if logprobs else 0
        self.seq = CachedSequence(verifier.target.model, list(token_ids), device=verifier.target.device,
                                  prefix_scope=prefix_scope)

    @property
    def token_ids(self) -> list[int]:
        """The committed sequence (prompt + generated tokens)."""
        return self.seq.token_ids

    @property
    def committed_len(self) -> int:
        """Length of the committed sequence, in tokens."""
        return len(self.seq.token_ids)

    def check(self, block: DraftBlock) -> None:
        """Refuse a block this session cannot verify.

        Raises:
            InvalidBlockError: a malformed block (:func:`validate_block`).
            ValueError: a block that would use a position at or beyond the target's context limit.
        """
        target = self._verifier.target
        k = block.k
        validate_block(block, target.emittable_vocab)
        if self.committed_len + k > target.max_positions:
            raise ValueError(
                f"block of K={k} after {self.committed_len} tokens exceeds the target's "
                f"{target.max_positions} positions"
            )

    def pending(self, block: DraftBlock) -> list[int]:
        """Cut the cache back for ``block`` and return the ids a forward must feed.

        Returns:
            the uncached committed tail followed by the K drafts (at least K + 1 ids).
        """
        upcoming = self.seq.token_ids + [int(t) for t in block.token_ids]
        kept = self.seq.sync(upcoming)
        return upcoming[kept:]

    def decide(self, block: DraftBlock, logits: torch.Tensor) -> VerifyResult:
        """Accept or reject ``block`` from the target's logits and commit the emitted tokens.

        Args:
            block: the verified block (K drafts).
            logits: ``[K + 1, V]`` float32, the target's logits at the positions predicting each
                draft and the one after the last (the cache must hold committed + all K drafts).

        Returns:
            The :class:`VerifyResult`; the committed sequence grows by ``accepted + 1`` tokens
            and the cache is cut back to the accepted prefix.
        """
        target = self._verifier.target
        if self.sampling.greedy and self.processing is None and not self.want_logprobs:
            logits = logits[:, : target.emittable_vocab]  # the argmax over emittable ids: a view, no masked copy
        else:
            logits = mask_unemittable(logits, target.emittable_vocab)
        raw = logits
        if self.processing is not None:  # row i sees the committed tokens and drafts 0..i-1
            logits = self.processing.apply(logits, self.seq.token_ids + block.token_ids.tolist())
        if self.sampling.greedy:
            n, tokens = verify_greedy(block.token_ids, logits)
        else:
            p = warp_probs(logits, self.sampling)  # [K+1, V] float32
            generator = step_generator(self.seed, self.committed_len, TARGET)
            n, tokens = rejection_sample(block.token_ids, block.q_ids, block.q_probs, p, generator)
        logprobs = top = None
        if self.want_logprobs:  # the target's own distribution (temperature 1, before processing)
            lp = torch.log_softmax(raw[: n + 1].float(), dim=-1)  # [n+1, V]
            logprobs = [float(lp[i, t]) for i, t in enumerate(tokens)]
            if self.top_logprobs:
                values, ids = torch.topk(lp, min(self.top_logprobs, lp.shape[-1]), dim=-1)  # [n+1, N]
                top = [list(zip(r_ids, r_vals)) for r_ids, r_vals in zip(ids.tolist(), values.tolist())]
        # Cache now holds committed + all K drafts; keep committed + accepted drafts.
        self.seq.commit(tokens, cached_upto=self.committed_len + n)
        return VerifyResult(accepted=n, token_ids=tokens, logprobs=logprobs, committed_len=self.committed_len,
                            top_logprobs=top)

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Score ``block`` with one target forward pass, decide, and commit the emitted tokens.

        This is the unbatched path (batch size 1); :meth:`TargetVerifier.verify_batch` verifies
        the blocks of many sessions in one forward with the same :meth:`check` and :meth:`decide`.
        Its forward's shape is left in the verifier's ``last_rows`` (1), ``last_positions`` (the
        uncached committed tail, e.g. a prompt, plus the K drafts) and ``last_context`` (the
        tokens cached before it), with :meth:`TargetVerifier.verify_batch`'s meanings.

        Args:
            block: K proposed tokens (K may be 0: plain decoding of one token).

        Returns:
            The :class:`VerifyResult`; the session's committed sequence grows by
            ``result.accepted + 1`` tokens and its cache is cut back to the accepted prefix.

        Raises:
            InvalidBlockError, ValueError: see :meth:`check`.
        """
        self.check(block)
        # what CachedSequence.forward_with does (sync, then feed the uncached tail and the block),
        # with the forward's shape kept for the verifier's last_* (as verify_batch keeps them)
        tokens = self.pending(block)  # uncached committed tail + the K drafts
        last = block.k + 1
        if len(tokens) < last:
            raise ValueError(f"asked for {last} logits but only {len(tokens)} positions are fed")
        context = float(len(self.seq.cached))  # tokens in the cache before the forward
        logits = self.seq.feed(tokens, keep=last)  # [K+1, V] float32
        v = self._verifier
        v.last_rows, v.last_positions, v.last_context = 1, len(tokens), context
        return self.decide(block, logits)

    def close(self) -> None:
        """Free the KV cache. Idempotent."""
        self.seq.close()


class TargetVerifier:
    """Owns the target model; opens one :class:`TargetSession` per sequence.

    Args:
        target: the target model (full vocabulary).
        lean: route the target's forwards (decode steps, verify blocks, prefill chunks, packed
            batches) through :func:`specdec.models.lean_decode.install`: the op sequence of
            transformers' Qwen2 forward without its wrappers and module dispatch, bitwise the same
            logits and cached keys and values (tests/test_lean_decode.py), so every output stays
            the target alone's; a model lean decode does not know (not Qwen2, or not
            shape-invariant, e.g. float32) is left as it is. False (the default here; the
            in-process :class:`specdec.engine.engine.SpeculativeEngine` and a served TP = 1 target
            worker turn it on, a sharded TP > 1 rank does not): the model is not touched.
            transformers' own ``generate`` on the same model (which passes a 2-D attention mask)
            keeps transformers' forward.
    """

    def __init__(self, target: LoadedModel, lean: bool = False):
        self.target = target
        #: whether the target's forwards run the lean forward (specdec.models.lean_decode)
        self.lean = False
        if lean:
            from specdec.models.lean_decode import install

            self.lean = install(target.model)
        #: positions fed by the last forward, of :meth:`verify_batch` or of an unbatched
        #: :meth:`TargetSession.verify` (for cost models and tests)
        self.last_positions = 0
        #: sessions fed by the last forward (prefill chunks included; 1 for an unbatched verify)
        self.last_rows = 0
        #: mean tokens in the KV cache of the sessions fed by the last forward, before it (what
        #: its query positions attend to besides their own; None: nothing fed)
        self.last_context: float | None = None

    def open_session(
        self, token_ids: Sequence[int], sampling: SamplingParams, seed: int, logprobs: bool = False,
        processing: LogitProcessing | None = None, top_logprobs: int = 0, prefix_scope: str = "",
    ) -> TargetSession:
        """Start verifying after ``token_ids`` (a prompt, or a full history to rebuild from).

        Args:
            processing: the request's output-dependent logit processing (penalties, bias,
                ``min_tokens``), applied to every scored position before warping; None: none.
            top_logprobs: with ``logprobs``, also return the N most likely ids per emitted token.
            prefix_scope: the prefix cache scope of the session (only sessions of the same scope
                share cached prefixes; :func:`specdec.engine.prefix_cache.prefix_scope`).

        Raises:
            ValueError: empty ``token_ids`` or ids outside the target's vocabulary.
        """
        ids = list(token_ids)
        if not ids:
            raise ValueError("a session needs at least one token")
        if min(ids) < 0 or max(ids) >= self.target.vocab_rows:
            raise ValueError(f"token id outside 0..{self.target.vocab_rows - 1}")
        return TargetSession(self, ids, sampling, seed, logprobs, processing, top_logprobs, prefix_scope)

    def verify_batch(
        self,
        items: Sequence[tuple[TargetSession, DraftBlock]],
        max_positions: int | None = None,
        caps: Sequence[int | None] | None = None,
    ) -> list[VerifyResult | Exception | None]:
        """Verify the blocks of several sessions in one target forward pass (continuous batching).

        Each session keeps its own KV cache (ragged lengths) and its block its own K; the
        positions every session must feed (its uncached committed tail, e.g. a prompt, plus its
        K drafts) are packed into one forward (:func:`specdec.kv_cache.feed_many`), then each row
        is decided on its own exactly as :meth:`TargetSession.verify` does (greedy, or rejection
        sampling with the session's own seeded generator) and its cache cut back to its accepted
        prefix. One item runs the unbatched path.

        ``max_positions`` bounds the positions of the forward (the positions budget). Items are
        taken in the given order (the caller orders them by fairness); an item that does not fit
        is either *chunked* (its committed tail, a prompt, is fed partly and the rest waits) or
        *deferred*; both answer None and the caller offers the same block again next time. The
        first item always runs (whole, or as a chunk of at least one position), so every call
        makes progress. Without a budget every item runs whole. ``caps`` bounds single items
        further (a tenant's fair share of the budget, :func:`specdec.engine.fairness.fair_budget_plan`):
        item i feeds at most ``caps[i]`` positions (chunked or deferred beyond), except a first
        item that cannot be chunked.

        Args:
            items: ``(session, block)`` pairs, at most one per session.
            max_positions: positions budget of the forward (None: unbounded).
            caps: per item, its own positions cap (None: only the budget), or None.

        Returns:
            per item: its :class:`VerifyResult`; an exception (:class:`InvalidBlockError` or
            ``ValueError`` from :meth:`TargetSession.check`, the session untouched; or whatever
            its :meth:`TargetSession.decide` raised after the forward, the session possibly
            half-advanced: close it); or None (chunked or deferred). One row's failure never
            fails the others.

        Raises:
            ValueError: a session given twice, or ``max_positions < 1``.
            Whatever the forward raised (then every session fed in it may be half-advanced and
            should be closed by the caller).
        """
        if max_positions is not None and max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        if len({id(s) for s, _ in items}) != len(items):
            raise ValueError("verify_batch: a session appears twice")
        if caps is not None and len(caps) != len(items):
            raise ValueError(f"verify_batch: {len(caps)} caps for {len(items)} items")
        results: list[VerifyResult | Exception | None] = [None] * len(items)
        feeds: list[tuple[CachedSequence, list[int], int]] = []
        whole: list[int] = []  # indices of items fed whole (decided after the forward)
        budget = max_positions if max_positions is not None else float("inf")
        for i, (session, block) in enumerate(items):
            try:
                session.check(block)
            except (ValueError, InvalidRequestError) as e:
                results[i] = e
                continue
            if budget <= 0:
                continue  # deferred
            tokens = session.pending(block)
            last = block.k + 1
            room = budget if caps is None or caps[i] is None else min(budget, caps[i])
            if room <= 0:
                continue  # deferred: its share is spent
            if len(tokens) <= room or not feeds and len(tokens) - last < 1:
                feeds.append((session.seq, tokens, last))
                whole.append(i)
                budget -= len(tokens)
            elif len(tokens) - last >= 1:  # chunk the committed tail; the block waits
                chunk = int(min(room, len(tokens) - last))
                feeds.append((session.seq, tokens[:chunk], 0))
                budget -= chunk
        self.last_context = sum(len(seq.cached) for seq, _, _ in feeds) / len(feeds) if feeds else None
        logits = feed_many(feeds)
        self.last_positions = sum(len(tokens) for _, tokens, _ in feeds)
        self.last_rows = len(feeds)
        j = 0
        for seq_tokens_keep, out in zip(feeds, logits):
            if seq_tokens_keep[2] == 0:
                continue
            i = whole[j]
            j += 1
            session, block = items[i]
            try:
                results[i] = session.decide(block, out)
            except Exception as e:  # this row's own failure: the other rows' results stand
                results[i] = e
        return results
