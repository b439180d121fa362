import sys, time, statistics
sys.argv = ["x", "320"]
exec(open("docs/bench/k0cost-s14/measure.py").read().replace('if __name__ == "__main__" and "profile" not in sys.argv:', 'if False:'))
from specdec.control import batch_controller as bc
new_probe_k = bc.BatchKController.probe_k
def old_probe_k(self, tenant, cap):  # the code before this change
    load = self._loads.get(tenant)
    if load is None or cap < 1:
        return 0
    what_if = dict(self._loads)
    what_if[tenant] = bc.TenantLoad(load.sessions, self.probe_alpha, load.weight, min(load.k_min, cap),
                                 min(load.k_max, cap), load.drafted, load.fixed_k, load.catchup_s, load.tokens_left)
    return bc.choose_batch_ks(what_if, self.cost, self.budget, self.catchup_horizon).ks.get(tenant, 0)
def arm(name):
    if name == "fixed": return batch(False)
    bc.BatchKController.probe_k = old_probe_k if name == "before" else new_probe_k
    try: return batch(True)
    finally: bc.BatchKController.probe_k = new_probe_k
ref = arm("fixed")[0]; assert arm("before")[0] == ref and arm("after")[0] == ref
names = ["fixed", "before", "after"]; W = {n: [] for n in names}; V = {n: [] for n in names}
for r in range(11):
    for n in (names if r % 2 == 0 else names[::-1]):
        t0 = time.process_time(); _, vs = arm(n); W[n].append((time.process_time() - t0) / N * 1e3); V[n].append(vs / N * 1e3)
for n in names:
    print(f"batch 8 rows {n:7s} CPU ms/tick median {statistics.median(W[n]):.3f} (verify {statistics.median(V[n]):.3f})  all {[round(x, 2) for x in W[n]]}")
