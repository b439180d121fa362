"""What a batch scheduler tells its K-under-load controller, and the K of an adaptive request.

Part of :mod:`specdec.engine.batch`. Before a tick plans its rows, :func:`decide_under_load`
hands a :class:`specdec.control.batch_k.BatchKController` the running load: sessions per
(tenant, proposer), the tokens each tenant's drafts are behind by (a tenant leaving K = 0 pays
its drafts' catch-up) and the tokens its sessions have left; the controller then picks one K
per tenant (:meth:`specdec.control.batch_controller.BatchKController.decide`). An adaptive
request asks for its K before every step through :func:`adaptive_k`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from specdec.engine.proposers.draft_model import DraftModelSession


def decide_under_load(controller: Any, running: Sequence[Any]) -> None:
    """One decision of ``controller`` for the ``running`` rows (each a
    :class:`specdec.engine.batch_request.BatchedRequest`), as served
    (:class:`specdec.control.batch_sessions.BatchKSessions`): a tenant leaving K = 0 pays its
    drafts' catch-up, spread over the tokens its sessions have left (their mean, at least 1)."""
    counts: dict[tuple[str, str], int] = {}
    behind: dict[str, int] = {}
    left: dict[str, list[int]] = {}
    for r in running:
        counts[(r.tenant, r.proposer)] = counts.get((r.tenant, r.proposer), 0) + 1
        p = r.generation.proposer
        behind[r.tenant] = behind.get(r.tenant, 0) + (p.behind() if isinstance(p, DraftModelSession) else 0)
        a = r.generation.assembler
        left.setdefault(r.tenant, []).append(max(0, a.max_tokens - len(a.token_ids)))
    controller.decide(counts, behind=behind, tokens_left={t: max(1.0, sum(v) / len(v)) for t, v in left.items()})


def adaptive_k(controller: Any, tenant: str, cap: int) -> Callable[[], int]:
    """The K callable of an adaptive request of ``tenant`` whose own K is ``cap``: the tenant's K
    under the last decision, at most ``cap``, or a probe's K while the tenant is held at K = 0
    (:meth:`specdec.control.batch_controller.BatchKController.step_k`)."""
    return lambda: controller.step_k(tenant, cap)
