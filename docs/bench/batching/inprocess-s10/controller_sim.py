from specdec.control.batch_k import BatchKController
def ctl(one_client_warm):
    c = BatchKController(budget=128, weights={"code": 1.0, "creative": 1.0}, k_ranges={"code": (0, 4), "creative": (0, 4)})
    for _ in range(20):
        c.observe_tick(8, 8, 0.105, [])
        c.observe_tick(8, 40, 0.30, [(8, 0.06)])
    if one_client_warm:
        for _ in range(10):
            c.observe_tick(1, 5, 0.09, [(1, 0.03)])
            c.observe_tick(1, 1, 0.068, [])
    for _ in range(30):
        c.observe_row("code", "draft", 4, 4)
        c.observe_row("creative", "draft", 4, 1)
    return c
for w in (False, True):
    c = ctl(w)
    for n in (8, 6, 4, 2, 1):
        sess = {("code", "draft"): n // 2 + n % 2, ("creative", "draft"): n // 2} if n > 1 else {("code", "draft"): 1}
        d = c.decide(sess, behind={"code": 0, "creative": 0}, tokens_left={"code": 64, "creative": 64})
        print("one-client warm" if w else "many only", n, "sessions:", d.ks, f"{d.tokens_per_s:.1f}")
    print(c.cost.snapshot())
