"""What :class:`specdec.control.controller.KController` learned, as versioned plain data.

:class:`LearnedState` is mixed into the controller (it uses its ``estimator``,
``cost_model_factory``, ``clock``, ``_costs``, ``_state``, ``_lengths`` and ``_stops``): export to JSON-safe
data and import all or nothing, so a controller actor restarted from a snapshot resumes where
it was (:mod:`deployments.controller_actor`).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping

from specdec.control.k_decision import KState


def _finite_count(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
    return float(v)


class LearnedState:
    """Snapshot export and import of :class:`specdec.control.controller.KController` (module docstring)."""

    #: version of :meth:`export_learned`'s schema; data of another version is not imported
    SNAPSHOT_VERSION = 2
    #: fields of the per-(tenant, proposer) K state that a snapshot carries (all integers or None)
    _K_STATE_FIELDS = ("current_k", "pending_k", "pending_count", "zero_requests", "decisions", "probes", "switches")

    def export_learned(self) -> dict:
        """What the controller has learned, as plain data (JSON-safe, no pickled objects)::

            {"version": 2,
             "acceptance": AcceptanceEstimator.export_counts(),
             "costs": {proposer: CostModel.export_observations()},
             "k_state": [{"tenant", "proposer", "current_k", "pending_k", "pending_count",
                          "zero_requests", "decisions", "probes", "switches", "probed"}],
             "lengths": [[tenant, proposer, decayed steps per block length]],
             "stops": [[tenant, proposer, decayed blocks stopped per draft position,
                        decayed blocks continued past it]]}

        ``stops`` are the early-stop counts behind :meth:`KController.stop_hazards` (position j
        at index j - 1; in process, ``learn_early_stop``).

        Settings are not included: they come from the constructor, so a snapshot survives a
        change of settings or of the classes' code.
        """
        return {
            "version": self.SNAPSHOT_VERSION,
            "acceptance": self.estimator.export_counts(),
            "costs": {p: cm.export_observations() for p, cm in self._costs.items()},
            "k_state": [
                {"tenant": t, "proposer": p, **{f: getattr(st, f) for f in self._K_STATE_FIELDS},
                 "probed": st.last_probe_at is not None}
                for (t, p), st in self._state.items()
            ],
            "lengths": [[t, p, list(hist)] for (t, p), hist in self._lengths.items()],
            "stops": [[t, p, list(stopped), list(continued)] for (t, p), (stopped, continued) in self._stops.items()],
        }

    def import_learned(self, data: Mapping) -> None:
        """Replace the learned state with :meth:`export_learned`'s ``data``; all or nothing.

        Fields missing from a K state entry (written before they existed) take their defaults.
        Timestamps (time at K = 0, last probe) are set to now: the clock of the process that
        wrote the snapshot may not be this one's. Cost models are made by
        ``cost_model_factory`` and take the snapshot's measurements.

        Raises:
            ValueError: ``data`` is of another version.
            ValueError, TypeError, KeyError: ``data`` is not of this shape.
        """
        if not isinstance(data, Mapping) or data.get("version") != self.SNAPSHOT_VERSION:
            got = data.get("version") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"snapshot version {got!r}, this controller reads version {self.SNAPSHOT_VERSION}")
        now = self.clock()
        estimator = copy.copy(self.estimator)  # same settings; its counts are replaced
        estimator.import_counts(data["acceptance"])
        costs = {}
        for proposer, obs in dict(data["costs"]).items():
            cm = self.cost_model_factory(str(proposer))
            cm.import_observations(obs)
            costs[str(proposer)] = cm
        state: dict[tuple[str, str], KState] = {}
        for e in data["k_state"]:
            t, p = e["tenant"], e["proposer"]
            if not isinstance(t, str) or not isinstance(p, str):
                raise TypeError(f"k_state key must be two strings, got {t!r}, {p!r}")
            st = KState(zero_since=now, last_probe_at=now if e.get("probed") else None)
            for f in self._K_STATE_FIELDS:
                if f not in e:
                    continue
                v = e[f]
                if v is None and f in ("current_k", "pending_k"):
                    setattr(st, f, None)
                elif isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"k_state {f}: expected an integer >= 0, got {v!r}")
                else:
                    setattr(st, f, v)
            state[(t, p)] = st
        lengths: dict[tuple[str, str], list[float]] = {}
        for t, p, hist in data.get("lengths", []):  # absent in snapshots written before it existed
            if not isinstance(t, str) or not isinstance(p, str):
                raise TypeError(f"lengths key must be two strings, got {t!r}, {p!r}")
            lengths[(t, p)] = [_finite_count(x, "lengths") for x in hist]
        stops: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
        for t, p, stopped, continued in data.get("stops", []):  # absent in snapshots written before it existed
            if not isinstance(t, str) or not isinstance(p, str):
                raise TypeError(f"stops key must be two strings, got {t!r}, {p!r}")
            stopped = [_finite_count(x, "stops") for x in stopped]
            continued = [_finite_count(x, "stops") for x in continued]
            if len(stopped) != len(continued):
                raise ValueError(f"stops of {t!r}/{p!r}: {len(stopped)} stopped counts but {len(continued)} continued")
            stops[(t, p)] = (stopped, continued)
        self.estimator, self._costs, self._state, self._lengths = estimator, costs, state, lengths
        self._stops = stops
