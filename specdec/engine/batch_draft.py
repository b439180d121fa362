"""One tick's drafting for a batch scheduler: batched draft forwards per draft model, the rest alone.

Part of :mod:`specdec.engine.batch`: :func:`draft_blocks` gives every row that needs a new
block its :class:`specdec.types.DraftBlock` (empty at K = 0 or without a proposer), drafting
the draft-model sessions of one draft model together
(:meth:`specdec.engine.proposers.draft_model.DraftModelProposer.propose_batch`: one batched
draft forward per draft position, chunked draft prefill) and prompt lookup row by row.
"""

from __future__ import annotations

from typing import Any, Sequence

from specdec.engine.proposers.draft_model import DECODE_TAIL, DraftModelSession
from specdec.types import DraftBlock

#: a draft forward feeding this many positions beyond one a row is a catch-up worth pricing
CATCHUP_MIN_POSITIONS = 8


def draft_blocks(need: Sequence[tuple[Any, int]], *, batched: bool, max_prefill: int, controller: Any = None,
                 draft_trace: list[tuple[int, int]] | None = None) -> list[tuple[int, float]]:
    """Set ``r.block`` for every ``(r, k)`` of ``need`` (``r`` a
    :class:`specdec.engine.batch_request.BatchedRequest`; ``r.block`` stays None for a session
    whose draft prefill is chunked over later ticks).

    Args:
        need: the rows that need a new block and their K (>= 0).
        batched: False drafts every row alone (the batch-size-1 path).
        max_prefill: draft prefill positions per call of ``propose_batch`` (chunked draft prefill).
        controller: a :class:`specdec.control.batch_k.BatchKController` or None; a draft forward
            that fed a prompt or the catch-up of tokens decoded at K = 0 is priced for it as a
            catch-up (:meth:`specdec.control.batch_cost.BatchCostModel.observe_catchup`), not as a
            draft position.
        draft_trace: ``(rows, positions)`` of every batched draft forward is appended to it.

    Returns:
        ``(rows, seconds)`` of the batched draft forwards that fed only draft positions (at most
        ``DECODE_TAIL`` a row): what the controller's draft cost learns from.
    """
    decode_timings: list[tuple[int, float]] = []
    groups: dict[int, list[tuple[Any, int]]] = {}
    for r, k in need:
        proposer = r.generation.proposer
        if proposer is None or k <= 0:
            r.block = DraftBlock.empty()
        elif batched and isinstance(proposer, DraftModelSession):
            groups.setdefault(id(proposer._proposer), []).append((r, k))
        else:
            r.block = proposer.propose(k)
    for rows in groups.values():
        sessions = [r.generation.proposer for r, _ in rows]
        timings: list[tuple[int, float]] = []
        trace: list[tuple[int, int]] = []
        blocks = sessions[0]._proposer.propose_batch(sessions, [k for _, k in rows], timings=timings,
                                                     max_prefill=max_prefill, trace=trace)
        if draft_trace is not None:
            draft_trace += trace
        # the controller measures draft positions: a forward that also fed a prompt's prefill or
        # the catch-up of tokens decoded at K = 0 (more than DECODE_TAIL positions per row) is no
        # draft position's cost, and taken as one it would hold tenants at K = 0; it is a
        # catch-up's: its seconds beyond a draft forward of as many rows, per position beyond one
        # a row (BatchCostModel.observe_catchup, as served)
        for t, (n, positions) in zip(timings, trace):
            if positions <= DECODE_TAIL * n:
                decode_timings.append(t)
            elif controller is not None and positions - n >= CATCHUP_MIN_POSITIONS:
                cost = controller.cost
                cost.observe_catchup(positions - n, max(0.0, t[1] - cost.draft_s(n)))
        for (r, _), block in zip(rows, blocks):
            r.block = block
    return decode_timings
