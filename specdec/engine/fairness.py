"""Fair shares of a batched forward among tenants: which rows go first, and how many positions each
tenant may use.

Used by the in-process :class:`specdec.engine.batch.BatchScheduler` and by the served target's
session table (deployments/target_sessions.py): each tenant gets its weighted max-min fair share
of the positions budget (weights from the tenant policy, ``batch_weight``), so a burst from one
tenant cannot push another tenant's steps, or its new prompt's prefill, out of the forwards.
"""

from __future__ import annotations

from typing import Any, Callable

def fair_order(items: list, tenant_of: Callable[[Any], str], weights: dict[str, float], tick: int) -> list:
    """Items in weighted round robin over their tenants, the first tenant rotating with ``tick``.

    Within a tenant items keep their given order. A tenant of weight w gets w turns per round
    (weights rounded, at least 1). Used to order the rows of a batched forward for its
    positions budget, in process and on the target replica.
    """
    by_tenant: dict[str, list] = {}
    for r in items:
        by_tenant.setdefault(tenant_of(r), []).append(r)
    tenants = sorted(by_tenant)
    if tenants:
        shift = tick % len(tenants)
        tenants = tenants[shift:] + tenants[:shift]
    out: list = []
    while any(by_tenant.values()):
        for t in tenants:
            turns = max(1, int(round(weights.get(t, 1.0))))
            for _ in range(turns):
                if by_tenant[t]:
                    out.append(by_tenant[t].pop(0))
    return out


def weighted_shares(demand: dict[str, int], weights: dict[str, float], budget: int) -> dict[str, int]:
    """Weighted max-min fair ("water-filling") split of ``budget`` positions over tenants.

    A tenant asking for less than its weighted share gets what it asks for, and the rest is
    split again among the others by weight; integer shares, leftover positions go one by one to
    the tenants still short, in name order. Σ shares = min(budget, Σ demand).

    Args:
        demand: tenant -> positions its waiting rows need (≥ 0).
        weights: tenant -> weight (> 0; missing: 1).
        budget: positions to split (≥ 0).
    """
    share = {t: 0 for t in demand}
    open_ = {t for t, d in demand.items() if d > 0}
    left = max(0, int(budget))
    while open_ and left > 0:
        total_w = sum(max(weights.get(t, 1.0), 1e-9) for t in open_)
        fair = {t: left * max(weights.get(t, 1.0), 1e-9) / total_w for t in open_}
        done = [t for t in open_ if demand[t] - share[t] <= fair[t]]
        if done:
            for t in done:
                left -= demand[t] - share[t]
                share[t] = demand[t]
                open_.discard(t)
            continue
        for t in sorted(open_):
            give = int(fair[t])
            share[t] += give
            left -= give
        for t in sorted(open_):
            if left <= 0:
                break
            share[t] += 1
            left -= 1
        break
    return share


def fair_budget_plan(items: list, tenant_of: Callable[[Any], str], cost_of: Callable[[Any], int],
                     prefill_of: Callable[[Any], int], weights: dict[str, float], budget: int | None,
                     tick: int) -> tuple[list, list[int | None]]:
    """Order the rows of one batched forward and cap them so each tenant gets its fair share.

    Each tenant's share of the positions budget is its weighted max-min fair share of what its
    rows need (:func:`weighted_shares`). A tenant's rows (decode rows in the given order, then
    prefills shorter first) are *in share* while they fit in it; a prefill that straddles the
    share's end is in share with a cap of what is left of it (it is chunked to that). In-share
    rows go first (decode rows in weighted round robin, :func:`fair_order`, then prefills shorter
    first), then the rest in the same order, which runs only on leftover budget. So a burst
    from one tenant can neither push another tenant's decode rows out of a forward nor stall its
    new prompt: that prompt is prefilled by at least its tenant's share per forward. A tenant
    none of whose rows fits its share still gets its first row in share (progress).

    Without a budget: every row, :func:`fair_order`, then decode rows before prefills, no caps.

    Args:
        items: the rows waiting (given order = arrival order within a tenant).
        tenant_of, cost_of, prefill_of: a row's tenant, positions it feeds, and prompt tail
            still to prefill (0 for a decode row).
        weights: tenant -> weight (policy ``batch_weight``).
        budget: positions budget of the forward, or None.
        tick: forward counter (rotates the round robin's first tenant).

    Returns:
        ``(order, caps)``: the rows in budget order, and per row its positions cap or None.
    """
    def within(rows: list) -> list:
        order = fair_order(rows, tenant_of, weights, tick)
        order.sort(key=lambda r: prefill_of(r))  # stable: decode rows (0) keep the fair order
        return order

    if budget is None:
        return within(list(items)), [None] * len(items)
    by_tenant: dict[str, list] = {}
    for r in items:
        by_tenant.setdefault(tenant_of(r), []).append(r)
    shares = weighted_shares({t: sum(cost_of(r) for r in rows) for t, rows in by_tenant.items()}, weights, budget)
    first: list = []
    rest: list = []
    caps: dict[int, int] = {}
    for t, rows in by_tenant.items():
        rows = sorted(rows, key=lambda r: prefill_of(r))  # stable
        used, open_ = 0, True
        for r in rows:
            c = cost_of(r)
            if open_ and used + c <= shares[t]:
                first.append(r)
                used += c
            elif open_ and prefill_of(r) > 0 and shares[t] - used >= 1:
                first.append(r)
                caps[id(r)] = shares[t] - used
                used = shares[t]
                open_ = False
            elif open_ and used == 0:  # nothing fits its share: its first row still goes
                first.append(r)
                used = c
                open_ = False
            else:
                open_ = False
                rest.append(r)
    order = within(first) + within(rest)
    return order, [caps.get(id(r)) for r in order]
