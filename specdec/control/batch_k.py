"""K under load: speculation lengths per tenant that maximise the tokens/s of the whole batch.

With continuous batching one target forward verifies every running session, so a tenant's K
costs everyone: a step takes

    T(K) = Σ_{j < max K} D(rows drafting at position j) + V(rows, P),   P = Σ_sessions (K_s + 1)

seconds (D: one batched draft forward, V: one batched verify forward, both measured by
:class:`BatchCostModel`), and emits Σ_s E[N(α_t(s), K_s)] tokens (E[N] of Leviathan et al. 2023,
§3.3, per tenant acceptance α̂). :func:`choose_batch_ks` picks one K per tenant maximising

    tokens/s = Σ_t n_t · E[N(α_t, K_t)] / T(K)

within each tenant's K range, under a fair share of the positions budget: tenant t may use at
most max(n_t, B · w_t / Σ_active w) positions (weights from the tenant policy). A tenant whose
speculation slows the others more than it gains lands at K = 0 because that maximises the sum.
This extends :mod:`specdec.controller` (one request's step time) to the batch; the per-tenant
α̂ comes from the same :class:`specdec.control.acceptance.AcceptanceEstimator`.

The parts, one job each (all re-exported here):

- :mod:`specdec.control.batch_cost`: :class:`BatchCostModel`, measured seconds of batched forwards;
- :mod:`specdec.control.batch_choice`: :class:`TenantLoad`, :class:`BatchKDecision`,
  :func:`choose_batch_ks`, one decision;
- :mod:`specdec.control.batch_controller`: :class:`BatchKController`, decisions and probes for a
  batch scheduler;
- :mod:`specdec.control.goodput_guard`: :class:`GoodputGuard`, measurement overruling the model;
- :mod:`specdec.control.batch_sessions`: :class:`BatchKSessions`, the served (per replica) form;
- :mod:`specdec.control.batch_exchange`: :func:`merge_report` and the acceptance exchange
  between draft replicas.
"""

from __future__ import annotations

from specdec.control.batch_choice import BatchKDecision, TenantLoad, choose_batch_ks
from specdec.control.batch_controller import BatchKController
from specdec.control.batch_cost import BatchCostModel
from specdec.control.batch_exchange import merge_report
from specdec.control.batch_sessions import BatchKSessions
from specdec.control.goodput_guard import GoodputGuard

__all__ = ["BatchCostModel", "BatchKController", "BatchKDecision", "BatchKSessions", "GoodputGuard", "TenantLoad",
           "choose_batch_ks", "merge_report"]
