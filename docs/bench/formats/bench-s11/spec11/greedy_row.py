"""Per drafted token: greedy token + early-stop probability from a 65,536-id subset row, widened to
the full vocabulary (before cd70282) vs over the subset row itself (after). One thread; min/median
of 300 calls, alternating. usage: python greedy_row.py"""
import time

import torch

from specdec.engine.sampling import greedy_token, mask_unemittable
from specdec.models.vocab_subset import expand_logits

torch.set_num_threads(1)
ids = torch.sort(torch.randperm(151665, generator=torch.Generator().manual_seed(0))[:65536]).values
logits = torch.randn(1, 65536, generator=torch.Generator().manual_seed(1))


def widened():
    full = mask_unemittable(expand_logits(logits, ids, 151936), 151665)[0]
    t = int(greedy_token(full))
    return t, float(torch.softmax(full.float(), dim=-1)[t])


def subset_row():
    j = int(greedy_token(logits[0]))
    return int(ids[j]), float(torch.softmax(logits[0], dim=-1)[j])


a, b = widened(), subset_row()
print(f"token {a[0]} / {b[0]}, probability {a[1]!r} / {b[1]!r} (softmax over 151,936 vs 65,536 entries: the sum's order differs, so the last bits may)")
for f in (widened, subset_row, widened, subset_row):
    ts = []
    for _ in range(300):
        c = time.perf_counter()
        f()
        ts.append(time.perf_counter() - c)
    ts.sort()
    print(f"{f.__name__}: {ts[0] * 1e6:.1f} us min, {ts[150] * 1e6:.1f} us median")
