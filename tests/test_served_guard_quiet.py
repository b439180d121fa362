"""The served goodput guards' held-back steps: BatchKSessions records the steps of quiet guards
(GoodputGuard.quiet_run) in one GoodputGuard.record_quiet_steps call before anything reads them;
every observable value equals the per-step reference's (main d33debe), bit for bit."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from specdec.control import batch_sessions
from specdec.control.batch_k import BatchKController, BatchKSessions, GoodputGuard
from specdec.types import BatchShape


class _PerStep(BatchKSessions):
    """BatchKSessions._guard_step_locked before quiet guards held their steps back (main d33debe):
    one GoodputGuard.record per step and tenant, in tenant order: the reference."""

    def _guard_step_locked(self, tenant, k, tokens, seconds):
        if k > 0 and (self._forced_locked(tenant) or self.controller.k_for(tenant) == 0):
            return
        active = self._recount()[1]
        bound = self._plain_bound_locked()
        serving = self._serving()
        exploring = sum(1 for o in self._guards.values() if o.exploring)
        for t in sorted(active):
            g = self._guards.get(t)
            if g is None:
                continue
            was, was_exploring = g.forced, g.exploring
            regime = "plain" if was or not (self.controller.k_for(t) or 0) > 0 else "spec"
            g.record(regime, tokens, seconds, may_explore=exploring - was_exploring == 0, plain_bound=bound,
                     sessions=serving)
            exploring += g.exploring - was_exploring
            if g.forced != was:
                self._dirty = True


class _Shuffled(BatchKController):
    """A controller whose decisions move tenants' K at random (seeded): regimes switch often."""

    def __init__(self, seed: int, **kw):
        super().__init__(**kw)
        self._rng = random.Random(seed)

    def decide(self, *args, **kw):
        d = super().decide(*args, **kw)
        ks = {t: (self._rng.choice((0, 0, 1, 3)) if self._rng.random() < 0.6 else k) for t, k in d.ks.items()}
        self.last = dataclasses.replace(d, ks=ks)
        self.k_by_tenant.update({t: k for t, k in ks.items() if "\x00" not in t})
        return self.last


def _live(cls, seed: int, template: GoodputGuard) -> BatchKSessions:
    c = _Shuffled(seed, budget=64, clock=lambda: 0.0)
    for rows in (1, 2, 4, 8):
        for positions in (rows, rows * 2, rows * 5):
            for _ in range(3):
                c.observe_tick(rows, positions, 0.05 + 0.002 * positions, [(rows, 0.004 * rows)])
    return cls(c, guard=template)


def _template(rng: random.Random) -> GoodputGuard:
    m = rng.choice((1, 2, 3, 6))
    return GoodputGuard(min_steps=m, explore_every=m * rng.choice((1, 2, 5)), first_explore=m * rng.choice((1, 2)),
                        hold=rng.choice((1, 2, 5, 17, 40)), max_backoff=rng.choice((1, 4)),
                        explore_backoff=rng.choice((1, 8)), margin=rng.choice((0.0, 0.1)),
                        decay=rng.choice((0.8, 0.97, 1.0)), outlier_clip=rng.choice((1.2, 2.0, float("inf"))),
                        compare_on_explore_end=rng.random() < 0.5, skip_margin=rng.choice((None, 0.0, 0.25)),
                        resize_ratio=rng.choice((1.01, 1.3, 1.5, 3.0, float("inf"))))


def _guards_state(live: BatchKSessions) -> dict:
    return {t: vars(g) for t, g in live.guards.items()}


def test_held_back_steps_keep_every_observable_value_bit_for_bit(monkeypatch):
    """Random runs (guard settings; 1 to 7 tenants; generations joining and leaving, so the sessions
    serving change and drop regimes; decisions moving every tenant's K; probes; outlier seconds;
    steps interleaved with every kind of read: the guards, tenant_stats, tenant_view(s), stats, K):
    every read and the guards' whole state equal the per-step reference's at every read."""
    held = events = resized = 0
    for seed in range(50):
        rng = random.Random(seed)
        monkeypatch.setattr(batch_sessions, "_LOG_MAX", rng.choice((3, 7, 4096)))  # the log emptied often or not
        template = _template(rng)
        fast, ref = _live(BatchKSessions, seed, template), _live(_PerStep, seed, template)
        tenants = [f"t{i}" for i in range(rng.choice((1, 2, 4, 7)))]
        joined: list[tuple[str, int]] = []
        key = 0
        forward = 0
        for step in range(400):
            r = rng.random()
            if r < 0.06 or not joined:
                t = rng.choice(tenants)
                adaptive, prompt = rng.random() < 0.9, rng.choice((0, 20))
                for live in (fast, ref):
                    live.join((t, key), t, "draft", adaptive=adaptive, k_range=(0, 4) if adaptive else (2, 2),
                              prompt_tokens=prompt, max_tokens=64)
                joined.append((t, key))
                key += 1
                continue
            if r < 0.10 and len(joined) > 1:
                gone = joined.pop(rng.randrange(len(joined)))
                for live in (fast, ref):
                    live.leave(gone)
                continue
            if r < 0.16:
                kind = rng.randrange(6)
                t = rng.choice(tenants)
                if kind == 0:
                    assert _guards_state(fast) == _guards_state(ref), (seed, step)
                elif kind == 1:
                    assert fast.tenant_stats(t) == ref.tenant_stats(t), (seed, step)
                elif kind == 2:
                    assert fast.tenant_view(t) == ref.tenant_view(t), (seed, step)
                elif kind == 3:
                    assert fast.tenant_views() == ref.tenant_views(), (seed, step)
                elif kind == 4:
                    assert fast.stats() == ref.stats(), (seed, step)
                else:
                    assert [fast._forced_locked(u) for u in tenants] == [ref._forced_locked(u) for u in tenants]
                continue
            t, i = rng.choice(joined)
            k = fast.k_for(t, 4)
            assert k == ref.k_for(t, 4), (seed, step)
            if rng.random() < 0.05:
                k = rng.choice((1, 4))  # now and then a probe's K
            accepted = rng.randrange(0, k + 1)
            if rng.random() < 0.5:
                forward += 1
            shape = BatchShape(forward=forward, rows=rng.choice((1, 2, 4)), positions=rng.choice((4, 8, 20)),
                               seconds=rng.choice((0.05, 0.07)))
            draft_s = rng.choice((0.0005, 0.01, 0.02)) if k else 0.0005
            verify_s = rng.choice((0.05, 0.06, 0.1, 0.1, 0.4, 2.0))
            for live in (fast, ref):
                live.observe_step((t, i), k, accepted, shape, draft_s=draft_s, verify_s=verify_s)
            held += bool(fast._log)
        assert _guards_state(fast) == _guards_state(ref), seed
        assert fast.stats() == ref.stats() and fast.decisions == ref.decisions, seed
        assert {t: list(v) for t, v in fast.k_steps.items()} == {t: list(v) for t, v in ref.k_steps.items()}
        events += sum(g.vetoes + g.explorations for g in ref._guards.values())
        resized += sum(g.resized for g in ref._guards.values())
    assert held > 1000 and events > 50 and resized > 20, (held, events, resized)


def test_record_quiet_steps_equals_record_calls_and_quiet_run_keeps_forcings():
    """record_quiet_steps of a quiet run (quiet_run) leaves the guard bit for bit as the record()
    calls would; those calls keep `forced` and `exploring`; steps that are not quiet raise and
    record nothing."""
    checked = 0
    for seed in range(300):
        rng = random.Random(seed)
        g = _template(rng)
        for _ in range(rng.randrange(0, 120)):  # a random state: explorations, vetoes, resizes
            regime = "plain" if g.forced or rng.random() < 0.3 else "spec"
            g.record(regime, rng.choice((1.0, 3.0, 8.0)), rng.choice((0.1, 0.12, 0.5)),
                     sessions=rng.choice((None, 1, 2, 2, 3, 8)))
        regime = "plain" if g.forced or rng.random() < 0.7 else "spec"
        sessions = rng.choice((None, 1, 2, 3, 8))
        run = g.quiet_run(regime, rng.choice((5, 60, 1000)), sessions)
        steps = [(rng.choice((1.0, 2.0, 5.0)), rng.choice((0.1, 0.3, 2.5)), sessions) for _ in range(run)]
        ref = copy.deepcopy(g)
        forced, exploring = g.forced, g.exploring
        for tokens, seconds, s in steps:
            ref.record(regime, tokens, seconds, may_explore=rng.random() < 0.5, plain_bound=rng.choice((None, 1.0)),
                       sessions=s)
            assert (ref.forced, ref.exploring) == (forced, exploring), seed
        g.record_quiet_steps(regime, steps)
        assert vars(g) == vars(ref), seed
        checked += run > 0
        if g.forced or regime == "spec":  # one step more is not quiet (or not a quiet run asked)
            before = repr(vars(g))
            extra = g.quiet_run(regime, 10 ** 6, sessions) + 1
            with pytest.raises(ValueError, match="not quiet"):
                g.record_quiet_steps(regime, [(1.0, 0.1, sessions)] * extra)
            assert repr(vars(g)) == before
    assert checked > 150


def test_quiet_run_stops_before_a_resize_that_ends_a_veto():
    g = GoodputGuard(min_steps=1, explore_every=1, first_explore=1, hold=50, resize_ratio=1.5)
    g.record("spec", 1.0, 1.0, sessions=2)  # spec measured at 2 sessions: the first exploration
    assert g.exploring
    g.record("plain", 10.0, 1.0, sessions=2)
    g.record("spec", 1.0, 1.0, sessions=2)  # compared: vetoed
    assert g.forced and not g.exploring and g.vetoes == 1
    assert g.quiet_run("plain", 1000, 2) == 49
    assert g.quiet_run("plain", 1000, 4) == 0  # 4 sessions against spec's 2: the first step ends the veto
    with pytest.raises(ValueError, match="end the veto"):
        g.record_quiet_steps("plain", [(1.0, 1.0, 4)])
    assert g.forced and g._forced_left == 50
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        g.record_quiet_steps("plain", [(1.0, 1.0, 0)])


def test_a_step_of_infinite_seconds_raises_as_the_per_step_recording_did():
    for cls in (BatchKSessions, _PerStep):
        live = _live(cls, 0, GoodputGuard(min_steps=2))
        live.join("a", "t0", "draft", k_range=(0, 4))
        live.join("b", "t1", "draft", k_range=(0, 4))
        shape = BatchShape(forward=0, rows=2, positions=2, seconds=0.05)
        for key in ("a", "b", "a", "b"):
            live.observe_step(key, 0, 0, shape, draft_s=0.0005, verify_s=0.1)
        with pytest.raises(ValueError, match="seconds < inf"):
            live.observe_step("a", 0, 0, shape, draft_s=0.0005, verify_s=float("inf"))
        assert {t: g.steps("plain") for t, g in live.guards.items()} == {"t0": 2, "t1": 2}  # each first step prefilled
