"""Acceptance counts shared by the draft replicas: reports of recorded steps and adopting the pool.

Part of :mod:`specdec.control.batch_k`. Acceptance is the tenant's (its traffic against the
draft/target pair), not the replica's, so each replica sends the steps it recorded to a shared
pool (:func:`merge_report`) and adopts the pooled counts (:meth:`AcceptanceExchange.merge_pooled`).
"""

from __future__ import annotations

import collections

from specdec.control.acceptance import AcceptanceEstimator


def merge_report(pool: AcceptanceEstimator, report: dict, max_steps: int = 1_000_000) -> int:
    """Add one replica's :meth:`BatchKSessions.take_sync_report` to a shared ``pool``, in the
    replica's order: each segment's steps (each recorded as :meth:`AcceptanceEstimator.record`
    records one step), then the segment's evidence cap. Everything is checked before anything is
    added.

    Returns:
        the number of steps added.

    Raises:
        ValueError: a malformed entry (names not strings, K or accepted out of range, a count
            below 1, more than ``max_steps`` steps in all, a negative cap).
    """
    plan = []
    total = 0
    for seg in report.get("segments", []):
        steps = []
        for entry in seg.get("steps", []):
            t, p, k, a, n = entry
            if not isinstance(t, str) or not isinstance(p, str):
                raise ValueError(f"step entry {entry!r}: tenant and proposer must be strings")
            k, a, n = int(k), int(a), int(n)
            if not (1 <= k <= 1024 and 0 <= a <= k and n >= 1):
                raise ValueError(f"step entry {entry!r}: need 1 <= K <= 1024, 0 <= accepted <= K, count >= 1")
            steps.append(((t, p), k, a, n))
            total += n
        cap = seg.get("cap")
        if cap is not None:
            t, p, x = cap
            if not isinstance(t, str) or not isinstance(p, str) or not float(x) >= 0:
                raise ValueError(f"cap {cap!r}: need tenant, proposer, trials >= 0")
            cap = ((t, p), float(x))
        plan.append((steps, cap))
    if total > max_steps:
        raise ValueError(f"a report of more than {max_steps} steps")
    for steps, cap in plan:
        for key, k, a, n in steps:
            for _ in range(n):
                pool.record(key, k, a)
        if cap is not None:
            pool.cap_evidence(*cap)
    return total


def _segment_data(counts, cap) -> dict:
    return {"steps": [[t, p, k, a, n] for (t, p, k, a), n in sorted(counts.items())],
            "cap": None if cap is None else [cap[0], cap[1], float(cap[2])]}


class AcceptanceExchange:
    """The acceptance counts a draft replica shares with the others (mixed into
    :class:`specdec.control.batch_sessions.BatchKSessions`, whose ``_lock``, ``controller``,
    ``_segments``, ``_unsynced``, ``_dirty`` and :meth:`tenant_views` it uses): the report of
    the steps recorded since the last exchange, putting back an undelivered one, and adopting
    the pooled counts (:mod:`deployments.controller_actor` pools them).
    """

    def take_sync_report(self) -> dict:
        """The speculation steps recorded here since the last report, for the pool of
        acceptance counts all draft replicas share (:meth:`merge_pooled`), as plain data::

            {"segments": [{"steps": [[tenant, proposer, K, accepted, count], ...],
                           "cap": [tenant, proposer, trials] or None}, ...],
             "raw_steps": [[tenant, proposer, K > 0 steps this replica's estimate holds], ...],
             "tenants": {tenant: its K under load here, :meth:`tenant_view`}}

        A segment's ``cap`` is the evidence cap a probe started here applied after the
        segment's steps (:meth:`AcceptanceEstimator.cap_evidence`), so that the pool caps the
        same history the replica did. Acceptance is the tenant's (its traffic against the
        draft/target pair), not the replica's, so every replica should estimate it from all
        replicas' steps; the costs (batched forwards of this replica's hardware and batch) and
        the K chosen from them stay per replica. The steps are taken out:
        :meth:`restore_report` puts them back when the report could not be delivered.
        """
        with self._lock:
            segs = [_segment_data(c, cap) for c, cap in self._segments] + [_segment_data(self._unsynced, None)]
            self._segments, self._unsynced = [], collections.Counter()
            est = self.controller.estimator
            raw = [[t, p, est.raw_steps((t, p))] for t, p in est.keys()]
        return {"segments": segs, "raw_steps": raw, "tenants": self.tenant_views()}

    def restore_report(self, report: dict) -> None:
        """A report of :meth:`take_sync_report` was not delivered: its steps (and caps) go with
        the next, before those recorded since."""
        with self._lock:
            old = []
            for seg in report["segments"]:
                c = collections.Counter({(t, p, int(k), int(a)): int(n) for t, p, k, a, n in seg["steps"]})
                old.append((c, None if seg.get("cap") is None else tuple(seg["cap"])))
            last_counts, _ = old.pop()  # the open segment of the report: merge with the steps since
            if self._segments:
                first_counts, first_cap = self._segments[0]
                self._segments[0] = (last_counts + first_counts, first_cap)
            else:
                self._unsynced = last_counts + self._unsynced
            self._segments = old + self._segments

    def merge_pooled(self, pooled: dict, report: dict) -> list[tuple[str, str]]:
        """Adopt the shared pool's counts after it merged ``report`` (the pool's
        :meth:`AcceptanceEstimator.export_counts`): each key's counts become the pool's, then the
        steps (and probe caps) recorded here since ``report`` was taken are replayed onto them
        (they go to the pool with the next report). A key for which the pool holds fewer steps
        than this replica did when ``report`` was taken keeps its own counts (the pool lost
        data, e.g. a controller actor restarted without its snapshot). The global pools (priors
        of keys new to this replica) are taken as they are.

        Returns:
            the keys whose counts were taken from the pool.

        Raises:
            ValueError, TypeError, KeyError: ``pooled`` is not of that shape (nothing changed).
        """
        entries = [(str(t), str(p), c) for t, p, c in pooled["keys"]]
        glob = dict(pooled.get("global") or {})
        had = {(t, p): int(n) for t, p, n in report.get("raw_steps", [])}
        taken = []
        with self._lock:
            est = self.controller.estimator
            backup = est.export_counts()
            try:
                for proposer, counts in glob.items():
                    est.set_global(proposer, counts)
                for t, p, counts in entries:
                    if int(counts.get("raw_steps", 0)) < had.get((t, p), 0):
                        continue
                    est.set_counts((t, p), counts)
                    taken.append((t, p))
            except Exception:
                est.import_counts(backup)
                raise
            for counts, cap in self._segments + [(self._unsynced, None)]:
                for (t, p, k, a), n in counts.items():
                    if (t, p) in taken:
                        for _ in range(n):
                            est.record((t, p), k, a)
                if cap is not None and (cap[0], cap[1]) in taken:
                    est.cap_evidence((cap[0], cap[1]), cap[2])
            self._dirty = True
        return taken
