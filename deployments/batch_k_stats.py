"""``GetTenantStats``' K under load with several draft replicas: one defined answer.

Each draft replica chooses K for its own batch (:class:`specdec.control.batch_k.BatchKSessions`),
so a tenant served by N replicas has up to N values of K under load. A router learns them from
two places: the replica that answers its ``BatchKStats`` call (Serve picks one; current) and the
views every replica sent to the shared controller with its last acceptance exchange
(:meth:`deployments.controller_actor.SharedTenantState.batch_k_views`; up to
``batch_k_sync_s`` old). :func:`merge_views` keeps one view per replica (the answering
replica's own answer over its reported view) and :func:`fill_batch_load` writes them into
``BatchLoad``:

- ``replicas``: every replica's view (K under load, the model's K, whether the goodput guard
  holds the tenant at K = 0, the rows and positions its steps ran in, how old the view is);
- ``k_under_load`` and ``k_under_load_replica``: the K of the replica whose decision for the
  tenant is the most recent (``decided_at``, Unix seconds; ties: the answering replica), named;
- ``tenant_steps``: the tenant's recent steps summed over the replicas, and
  ``tenant_rows_per_step`` / ``tenant_positions_per_step`` their means weighted by steps.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping


def merge_views(reported: Iterable[Mapping[str, Any]], answered: Mapping[str, Any] | None) -> list[dict]:
    """One view per replica: the ``reported`` ones (``SharedTenantState.batch_k_views``), with
    the replica that ``answered`` (``Draft.BatchKStats``, empty or None: none) replacing its own
    reported view (``reported_s_ago`` 0). Order: the answering replica first, then as reported."""
    out: dict[str, dict] = {}
    if answered:
        out[str(answered.get("replica", ""))] = dict(answered, reported_s_ago=0.0)
    for v in reported:
        out.setdefault(str(v.get("replica", "")), dict(v))
    return list(out.values())


def fill_batch_load(batch: Any, views: list[Mapping[str, Any]], now: float) -> None:
    """Write ``views`` (:func:`merge_views`) into ``batch``, a ``specdec.v1.BatchLoad`` message
    (module docstring); ``now``: Unix seconds (for ``decided_s_ago``). No views: unchanged."""
    if not views:
        return
    steps = sum(int(v.get("steps") or 0) for v in views)
    batch.tenant_steps = steps
    if steps:
        batch.tenant_rows_per_step = sum(float(v["rows_per_step"]) * int(v["steps"]) for v in views) / steps
        batch.tenant_positions_per_step = sum(float(v["positions_per_step"]) * int(v["steps"]) for v in views) / steps
    decided = [(float(v["decided_at"]), -i, v) for i, v in enumerate(views)
               if v.get("decided_at") is not None and v.get("k_under_load") is not None]
    if decided:
        latest = max(decided, key=lambda x: x[:2])[2]
        batch.k_under_load = int(latest["k_under_load"])
        batch.k_under_load_replica = str(latest.get("replica", ""))
    for v in views:
        r = batch.replicas.add(replica=str(v.get("replica", "")), guard_forced=bool(v.get("guard_forced")),
                               reported_s_ago=float(v.get("reported_s_ago") or 0.0),
                               tenant_rows_per_step=float(v.get("rows_per_step") or 0.0),
                               tenant_positions_per_step=float(v.get("positions_per_step") or 0.0),
                               tenant_steps=int(v.get("steps") or 0), sessions=int(v.get("sessions") or 0))
        if v.get("k_under_load") is not None:
            r.k_under_load = int(v["k_under_load"])
        if v.get("k_model") is not None:
            r.k_model = int(v["k_model"])
        if v.get("decided_at") is not None:
            r.decided_s_ago = max(0.0, now - float(v["decided_at"]))


_VIEW_INTS = ("k_under_load", "k_model", "steps", "sessions")
_VIEW_FLOATS = ("decided_at", "rows_per_step", "positions_per_step")


def checked_replica_views(raw: Any) -> dict[str, dict]:
    """The ``"tenants"`` of a draft replica's report (:meth:`BatchKSessions.tenant_views`, kept
    per replica by :meth:`deployments.controller_actor.SharedTenantState.sync_batch_acceptance`)
    as checked plain data: tenant -> view.

    Raises:
        ValueError: not a mapping of tenant name to a mapping of those fields (numbers >= 0,
            ``k_under_load``/``k_model``/``decided_at`` may be None).
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"tenants: expected a mapping, got {type(raw).__name__}")
    out = {}
    for t, v in raw.items():
        if not isinstance(t, str) or not isinstance(v, Mapping):
            raise ValueError(f"tenants: entry {t!r} is not tenant -> mapping")
        view: dict[str, Any] = {"guard_forced": bool(v.get("guard_forced", False))}
        for f in _VIEW_INTS + _VIEW_FLOATS:
            x = v.get(f)
            if x is None and f in ("k_under_load", "k_model", "decided_at"):
                view[f] = None
                continue
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 0 or x == float("inf"):
                raise ValueError(f"tenants: {t!r} {f}: expected a finite number >= 0, got {x!r}")
            view[f] = int(x) if f in _VIEW_INTS else float(x)
        out[t] = view
    return out
