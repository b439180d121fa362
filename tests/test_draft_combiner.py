"""DraftCombiner (specdec/engine/draft_combiner.py): one session's failing drafting fails that
session only; the others of its batch get exactly the blocks they would get alone."""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.engine.draft_combiner import DraftCombiner
from specdec.engine.proposers.draft_model import DraftModelProposer
from specdec.request import SamplingParams

#: (prompt, K, sampling, seed) of the sessions that draft together
SPECS = [
    ([5, 9, 14, 3, 27, 8], 4, SamplingParams(), 1),
    ([40, 41, 42, 43], 3, SamplingParams(), 2),
    ([7, 70, 17, 71, 18, 72, 19], 5, SamplingParams(temperature=0.8, top_k=20), 3),
]


def _open(proposer, specs=SPECS):
    return [proposer.open_session(list(p), sp, seed=seed) for p, _, sp, seed in specs]


def _together(combiner, sessions, ks):
    """Each session calls ``combiner.propose`` from its own thread at once; returns blocks or
    the exceptions raised, in order."""
    out: list = [None] * len(sessions)
    start = threading.Barrier(len(sessions))

    def one(i):
        start.wait()
        try:
            out[i] = combiner.propose(sessions[i], ks[i])
        except Exception as e:  # what the caller's generation would get
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _same(a, b, exact=False):
    """Blocks ``a`` and ``b`` agree: the same ids; q to the bit when ``exact`` (both drafted
    alone), else to 1e-5 (a batched forward's rows differ from a lone forward's in the last bits;
    tests/test_batch.py::test_propose_batch_equals_propose_alone)."""
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert (a.q_ids is None) == (b.q_ids is None)
    if a.q_ids is not None:
        assert torch.equal(a.q_ids, b.q_ids)
        assert torch.equal(a.q_probs, b.q_probs) if exact else torch.allclose(a.q_probs, b.q_probs, atol=1e-5)


def _commit_first_and(sessions, blocks, token=11):
    for s, b in zip(sessions, blocks):
        s.commit(b.token_ids.tolist()[:1] + [token])


@pytest.fixture()
def proposer(tiny_draft_close):
    return DraftModelProposer(tiny_draft_close)


@pytest.mark.parametrize("failure", ["closed", "bad token"])
def test_one_failing_session_leaves_the_others_of_its_batch_their_blocks(proposer, failure):
    """A session closed while it waits to draft (a cancelled request) or holding a token id past
    the draft's vocabulary fails the batched drafting; it gets its error, the two others get the
    blocks they get alone, and keep drafting right afterwards."""
    bad_prompt = [3, 4, 5] if failure == "closed" else [3, 10_000, 5]
    bad = proposer.open_session(bad_prompt, SamplingParams(), seed=9)
    if failure == "closed":
        bad.close()
    good, ref = _open(proposer), _open(proposer)
    ks = [k for _, k, _, _ in SPECS]
    combiner = DraftCombiner(window_s=1.0, linger_s=0.0)

    got = _together(combiner, [good[0], bad, good[1], good[2]], [ks[0], 4, ks[1], ks[2]])

    assert combiner.batch_sizes == [4]  # they did draft as one batch
    if failure == "closed":
        assert type(got[1]) is RuntimeError and str(got[1]) == "sequence is closed"
    else:
        assert type(got[1]) is IndexError
    alone = [s.propose(k) for s, k in zip(ref, ks)]
    for g, a in zip([got[0], got[2], got[3]], alone):
        _same(g, a, exact=True)
    # the next round, batched again without the failed session: still exactly as alone
    _commit_first_and(good, alone)
    _commit_first_and(ref, alone)
    got2 = _together(combiner, good, ks)
    assert combiner.batch_sizes == [4, 3]
    for g, a in zip(got2, [s.propose(k) for s, k in zip(ref, ks)]):
        _same(g, a)


def test_a_forward_failing_part_way_is_cut_out_of_every_cache(proposer, tiny_draft_close):
    """The packed draft forward raises in its second layer, after the first layer cached every
    session's new positions: each session drafts alone instead, from a cache with that partial
    forward cut out, and gets exactly its block alone (now and on the next round)."""
    layer = tiny_draft_close.model.model.layers[1]
    fails = []

    def fail_once(module, args):
        if not fails:
            fails.append(1)
            raise RuntimeError("layer 1 failed")

    good, ref = _open(proposer), _open(proposer)
    ks = [k for _, k, _, _ in SPECS]
    combiner = DraftCombiner(window_s=1.0, linger_s=0.0)
    # a first round that succeeds, so the caches hold the prompts when the failure comes
    first = _together(combiner, good, ks)
    alone = [s.propose(k) for s, k in zip(ref, ks)]
    for g, a in zip(first, alone):
        _same(g, a)
    _commit_first_and(good, alone)
    _commit_first_and(ref, alone)
    hook = layer.register_forward_pre_hook(fail_once)
    try:
        got = _together(combiner, good, ks)
    finally:
        hook.remove()
    assert fails == [1] and combiner.batch_sizes == [3, 3]
    alone = [s.propose(k) for s, k in zip(ref, ks)]
    for g, a in zip(got, alone):  # to 1e-5 only: the caches hold the batched first round
        _same(g, a)
    for s in good:
        assert all(layer.get_seq_length() == len(s.seq.cached) for layer in s.seq.cache.layers)
    _commit_first_and(good, alone, token=12)
    _commit_first_and(ref, alone, token=12)
    for g, a in zip(_together(combiner, good, ks), [s.propose(k) for s, k in zip(ref, ks)]):
        _same(g, a)


@pytest.mark.parametrize("peers, slept", [(lambda: 1, []), (lambda: 0, []), (lambda: 2, [0.5]), (None, [0.5])])
def test_the_window_is_skipped_when_no_other_generation_runs(proposer, monkeypatch, peers, slept):
    """One client alone waited the gathering window on every drafting step, for nobody: with the
    replica's generation count (``peers``) at most one the first caller drafts at once; with
    more, or unknown, it waits the window. Either way the block is the one drafted alone."""
    import specdec.engine.draft_combiner as dc

    sleeps: list[float] = []
    monkeypatch.setattr(dc.time, "sleep", sleeps.append)
    combiner = DraftCombiner(window_s=0.5, linger_s=0.0, peers=peers)
    session, ref = _open(proposer, SPECS[:1])[0], _open(proposer, SPECS[:1])[0]
    got = combiner.propose(session, 4)
    assert sleeps == slept and combiner.batch_sizes == [1]
    _same(got, ref.propose(4), exact=True)


def test_unbatched_drafting_is_propose_alone_and_times_every_forward(proposer, monkeypatch):
    """``batched=False``: each session drafts alone in its caller's thread, the very blocks of
    ``session.propose`` (q to the bit) over several steps (prompt, then after a rejection), and
    every draft forward is recorded once as ``(1, wall seconds)`` for the K-under-load cost model
    (before: none was, so an unbatched replica priced draft forwards on the prior)."""
    from specdec.engine.kv_cache import CachedSequence

    combiner = DraftCombiner(batched=False, max_prefill=2)  # no chunking unbatched: a prompt is fed whole
    mine, ref = _open(proposer), _open(proposer)
    forwards = [0]
    feed = CachedSequence.feed

    def counted(seq, tokens, keep=None):
        forwards[0] += 1
        return feed(seq, tokens, keep)

    for step in range(3):
        ks = [k for _, k, _, _ in SPECS]
        expected = [s.propose(k) for s, k in zip(ref, ks)]
        monkeypatch.setattr(CachedSequence, "feed", counted)
        forwards[0] = 0
        traced = len(combiner.trace)
        got = [combiner.propose(session, k) for session, k in zip(mine, ks)]  # one after another
        monkeypatch.setattr(CachedSequence, "feed", feed)
        for a, b in zip(got, expected):
            _same(a, b, exact=True)
        timings = combiner.take_timings()
        assert forwards[0] == sum(b.k for b in got) == len(combiner.trace) - traced
        new = list(combiner.trace)[traced:]
        assert all(rows == 1 for rows, _ in new)
        # the decode forwards only: each session's first forward of step 0 fed its whole prompt
        # (4-7 positions), a prefill, not a draft position's cost; later steps feed 2 then 1
        prefills = len(SPECS) if step == 0 else 0
        fed = sorted(p for _, p in new)
        assert fed[len(new) - prefills:] == (sorted(len(sp[0]) for sp in SPECS) if step == 0 else [])
        assert all(p <= 2 for p in fed[:len(new) - prefills])
        assert len(timings) == sum(b.k for b in got) - prefills and all(r == 1 and s > 0 for r, s in timings)
        assert combiner.take_timings() == []  # each once
        _commit_first_and(mine, got)
        _commit_first_and(ref, expected)
    assert combiner.batch_sizes == []  # no drafting batch ran
    # prompt lookup and plain decoding: nothing to time
    assert combiner.propose(None, 3).k == 0 and combiner.take_timings() == []


def test_unbatched_draftings_that_overlap_are_not_timed(proposer, monkeypatch):
    """Unbatched sessions draft in their own threads at once, sharing the device: a forward's
    wall seconds then hold the others' work too (8 sessions on 2 CPU cores: 0.20 s for a 0.036-s
    forward), which priced every tenant at K = 0 and kept a lone client there after the load had
    gone. Draftings that overlapped are left out of the timings (not of the trace); one alone is
    timed, every decode forward of it."""
    combiner = DraftCombiner(batched=False)
    mine = _open(proposer, SPECS[:2])
    both = threading.Barrier(2)
    inner = type(proposer).propose_batch

    def meeting(self, sessions, ks, timings=None, **kw):
        both.wait(10)  # both draftings are running
        out = inner(self, sessions, ks, timings, **kw)
        both.wait(10)  # neither has ended before the other's forwards
        return out

    monkeypatch.setattr(type(proposer), "propose_batch", meeting)
    ks = [k for _, k, _, _ in SPECS[:2]]
    got = _together(combiner, mine, ks)
    assert all(not isinstance(b, Exception) for b in got)
    assert combiner.take_timings() == [] and len(combiner.trace) == sum(b.k for b in got)
    monkeypatch.setattr(type(proposer), "propose_batch", inner)
    _commit_first_and(mine, got)
    alone = combiner.propose(mine[0], 3)  # alone now: its decode forwards timed
    timings = combiner.take_timings()
    assert len(timings) == alone.k == 3 and all(r == 1 and t > 0 for r, t in timings)
    assert combiner._unbatched_running == []
