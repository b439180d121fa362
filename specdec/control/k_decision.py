"""One K decision of the per-request controller, the per-step K it runs as, and a key's K state.

Part of :mod:`specdec.control.controller` (which re-exports :class:`KDecision` and
:func:`k_schedule`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from specdec.control.objective import KCandidate


@dataclass(frozen=True)
class KDecision:
    """An explainable K decision for one request (plain data).

    Attributes:
        tenant, proposer: whom it is for.
        k: the K to run with.
        reason: one of ``"speculation off"``, ``"fixed"``, ``"initial"``, ``"hold"``,
            ``"switch: gain"``, ``"switch: consistent"``, ``"switch: from K = 0"``, ``"clipped to range"``, ``"probe"``.
        alpha: the acceptance estimate used (α̂, prior included).
        alpha_evidence: decayed observed trials behind α̂ (0: prior only).
        position_alphas: measured per-position acceptance used (may be empty).
        expected_tokens: E[N(k)] for the chosen k.
        predicted_speedup: tokens/s at k over plain decoding.
        draft_s, verify_s, round_trip_s, step_time_s: cost terms of a step at k (seconds).
        baseline_step_time_s: step_time(0), plain decoding.
        k_min, k_max: the range chosen in (policy ∩ request).
        best_k: the unconstrained-by-hysteresis best K in the range (may differ from k).
        probe: True when this request is a re-probe from K = 0.
        probe_steps: for a probe, the number of steps run at ``k`` before plain decoding
            (None: the whole request); None otherwise.
        candidates: every K considered.
    """

    tenant: str
    proposer: str
    k: int
    reason: str
    alpha: float
    alpha_evidence: float
    position_alphas: tuple[float, ...]
    expected_tokens: float
    predicted_speedup: float
    draft_s: float
    verify_s: float
    round_trip_s: float
    step_time_s: float
    baseline_step_time_s: float
    k_min: int
    k_max: int
    best_k: int
    probe: bool = False
    probe_steps: int | None = None
    candidates: tuple[KCandidate, ...] = field(default=())

    def as_dict(self) -> dict:
        return asdict(self)

    def k_schedule(self) -> int | Callable[[], int]:
        """What to pass as ``k`` to :meth:`specdec.engine.engine.SpeculativeEngine.start`.

        ``k`` itself, except for a probe limited to ``probe_steps`` steps: then a callable that
        returns ``k`` for the first ``probe_steps`` calls (one per step) and 0 afterwards.
        """
        return k_schedule(self.k, self.probe_steps if self.probe else None)


def k_schedule(k: int, steps: int | None) -> int | Callable[[], int]:
    """``k`` for ``steps`` speculation steps, then 0 (plain ``k`` when ``steps`` is None)."""
    if steps is None:
        return k
    calls = [0]

    def schedule() -> int:
        calls[0] += 1
        return k if calls[0] <= steps else 0

    return schedule


@dataclass
class KState:
    """Per (tenant, proposer) state of :class:`specdec.control.controller.KController`: the K
    held, a pending switch, K = 0 and probe bookkeeping, counters, the last decision."""

    current_k: int | None = None
    pending_k: int | None = None
    pending_count: int = 0
    zero_requests: int = 0
    zero_since: float = 0.0
    last_probe_at: float | None = None
    probes_pending: int = 0  # probes decided whose results were not recorded yet
    decisions: int = 0
    probes: int = 0
    switches: int = 0
    last_decision: KDecision | None = None
