"""What a batch scheduler tells its K-under-load controller, and the K of an adaptive request.

Part of :mod:`specdec.engine.batch`. Before a tick plans its rows, :func:`decide_under_load`
hands a :class:`specdec.control.batch_k.BatchKController` the running load: sessions per
(tenant, proposer), the tokens each tenant's drafts are behind by (a tenant leaving K = 0 pays
its drafts' catch-up) and the tokens its sessions have left; the controller then picks one K
per tenant (:meth:`specdec.control.batch_controller.BatchKController.decide`). An adaptive
request asks for its K before every step through :func:`adaptive_k`, or through
:class:`TenantGuards` when per-tenant goodput guards overrule the controller (as served).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from specdec.engine.proposers.draft_model import DraftModelSession


def decide_under_load(controller: Any, running: Sequence[Any]) -> None:
    """One decision of ``controller`` for the ``running`` rows (each a
    :class:`specdec.engine.batch_request.BatchedRequest`), as served
    (:class:`specdec.control.batch_sessions.BatchKSessions`): a tenant leaving K = 0 pays its
    drafts' catch-up, spread over the tokens its sessions have left (their mean, at least 1); forwards
    are priced at the rows' mean tokens in the target's KV cache once their committed tokens are fed
    (``decide(..., context=)``: the committed length less the last token, which the next block feeds;
    a row whose prompt is not prefilled yet counts its prompt, which its decode forwards will attend
    to)."""
    counts: dict[tuple[str, str], int] = {}
    behind: dict[str, int] = {}
    left: dict[str, list[int]] = {}
    cached: list[int] = []
    for r in running:
        committed = getattr(r.generation.target, "committed_len", None)
        if committed is not None:  # what its decode forwards attend to (a row not yet prefilled: its prompt)
            cached.append(max(0, committed - 1))
        counts[(r.tenant, r.proposer)] = counts.get((r.tenant, r.proposer), 0) + 1
        p = r.generation.proposer
        behind[r.tenant] = behind.get(r.tenant, 0) + (p.behind() if isinstance(p, DraftModelSession) else 0)
        a = r.generation.assembler
        left.setdefault(r.tenant, []).append(max(0, a.max_tokens - len(a.token_ids)))
    controller.decide(counts, behind=behind, tokens_left={t: max(1.0, sum(v) / len(v)) for t, v in left.items()},
                      context=sum(cached) / len(cached) if cached else None)


def adaptive_k(controller: Any, tenant: str, cap: int) -> Callable[[], int]:
    """The K callable of an adaptive request of ``tenant`` whose own K is ``cap``: the tenant's K
    under the last decision, at most ``cap``, or a probe's K while the tenant is held at K = 0
    (:meth:`specdec.control.batch_controller.BatchKController.step_k`)."""
    return lambda: controller.step_k(tenant, cap)


class TenantGuards:
    """One :class:`specdec.control.goodput_guard.GoodputGuard` per tenant for an in-process
    scheduler, as the served :class:`specdec.control.batch_sessions.BatchKSessions` keeps them:
    measurement overrules the cost model. Every tick, each adaptive row's step (tokens = accepted
    + 1, weighted by the rows of the tick; seconds = the tick's drafting + verify wall time) is
    recorded in every tenant's guard, in regime ``spec`` when the last decision had that tenant
    at K > 0 and ``plain`` otherwise; a guard that measures speculation slower than plain
    decoding holds its tenant at K = 0 (the guard's docstring has the policy). Left out, as
    served: a generation's first step (it prefilled the target), a probe's step (K > 0 while the
    decision holds the tenant at K = 0) and a K > 0 step of a tenant whose guard forces K = 0.

    Why in process too: the cost model prices the forwards it measured, not the drafts' catch-up
    after K = 0 or contention; at 8 clients x 128 tokens (w8a8 pair, one thread, loaded machine)
    the model-only arm ran K > 0 on 285 of 592 steps at 0.75x the tokens per CPU second of K = 0
    (docs/bench/batching/inprocess-s10/README.md).

    Args:
        template: the guard whose settings every tenant's guard takes (:meth:`GoodputGuard.fresh`).
    """

    def __init__(self, template: Any):
        self.template = template
        #: tenant -> its guard (made when the tenant's first adaptive row is recorded)
        self.guards: dict[str, Any] = {}
        self._stepped: set[int] = set()  # request ids whose first step was seen

    def forced(self, tenant: str) -> bool:
        """Whether ``tenant``'s guard holds it at K = 0 now."""
        g = self.guards.get(tenant)
        return g is not None and g.forced

    def k(self, controller: Any, tenant: str, cap: int) -> Callable[[], int]:
        """The K callable of an adaptive request (:func:`adaptive_k`), 0 while the guard forces K = 0."""
        return lambda: 0 if self.forced(tenant) else controller.step_k(tenant, cap)

    def record_tick(self, controller: Any, rows: Sequence[tuple[int, str, int, int]], seconds: float) -> None:
        """One tick's adaptive rows ``(request id, tenant, K, accepted)`` and its wall ``seconds``.

        Raises:
            ValueError: from :meth:`GoodputGuard.record` (seconds not finite and > 0).
        """
        if not rows or not seconds > 0:
            return
        if not seconds < float("inf"):  # as GoodputGuard.record would at the first row, before any is taken
            raise ValueError(f"need 0 < seconds < inf, got {seconds}")
        n = len(rows)
        for _, tenant, _, _ in rows:
            if tenant not in self.guards:
                self.guards[tenant] = self.template.fresh()
        # A guard whose n steps are quiet (GoodputGuard.quiet_for: plain decoding while nothing is
        # forced, or a forcing with more than n steps left) keeps its regime, `forced` and
        # `exploring` through the tick and reads nothing of the others: its steps are recorded in one
        # record_quiet call after the loop, bit for bit what one record() per row gives. The others
        # ("loud": speculating, or a forcing that may end) record row by row, in tenant order, as
        # before: many tenants held at K = 0 no longer cost O(rows x tenants) record() calls a tick.
        quiet: dict[str, str] = {}
        loud: list[str] = []
        for t in sorted(self.guards):
            g = self.guards[t]
            regime = "plain" if g.forced or not (controller.k_for(t) or 0) > 0 else "spec"
            if g.quiet_for(regime, n):
                quiet[t] = regime
            else:
                loud.append(t)
        # guards exploring now, kept as each records (only a guard's own record changes it): "another
        # tenant's guard is exploring" in O(1), not O(tenants) per row and guard
        exploring = sum(1 for g in self.guards.values() if g.exploring)
        tokens: list[int] = []
        for rid, tenant, k, accepted in rows:
            first = rid not in self._stepped
            self._stepped.add(rid)
            if first or (k > 0 and (self.forced(tenant) or controller.k_for(tenant) == 0)):
                continue
            tokens.append((accepted + 1) * n)
            for t in loud:
                g = self.guards[t]
                regime = "plain" if g.forced or not (controller.k_for(t) or 0) > 0 else "spec"
                was = g.exploring
                g.record(regime, (accepted + 1) * n, seconds, may_explore=exploring - was == 0)
                exploring += g.exploring - was
        if tokens:
            for t, regime in quiet.items():
                self.guards[t].record_quiet(regime, tokens, seconds)

    def snapshot(self) -> dict:
        """tenant -> its guard's :meth:`GoodputGuard.snapshot`."""
        return {t: g.snapshot() for t, g in sorted(self.guards.items())}
