"""What the A/B scripts here share: eight cached sessions of the demo target and one timed packed forward."""
import random
import time

from specdec.engine.kv_cache import CachedSequence, feed_many

LENS = (170, 195, 220, 240, 260, 280, 300, 330)


def cached_sessions(model, rng: random.Random, lens=LENS) -> list:
    """One CachedSequence per length, each holding that many random token ids."""
    seqs = []
    for n in lens:
        ids = [rng.randrange(1000, 30000) for _ in range(n)]
        s = CachedSequence(model, list(ids))
        s.feed(ids, keep=1)
        seqs.append(s)
    return seqs


def timed_forward(items) -> tuple[float, list]:
    """Wall seconds and logits of one feed_many over ``items`` ((session, tokens, keep) each); every
    session is cut back afterwards, so each call sees the same caches."""
    before = [len(s.cached) for s, _, _ in items]
    t = time.perf_counter()
    out = feed_many(items)
    wall = time.perf_counter() - t
    for (s, _, _), b in zip(items, before):
        s._crop(b)
    return wall, out
