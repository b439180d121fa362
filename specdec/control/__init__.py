"""What decides: per-tenant speculation length K, tenants and their limits.

- :mod:`~specdec.control.acceptance`: per-tenant acceptance rate (truncated-geometric estimate,
  decayed, with a prior).
- :mod:`~specdec.control.cost_model`: measured draft / verify / round-trip costs.
- :mod:`~specdec.control.controller`: the K controller (:class:`KController`): K per tenant
  maximising expected tokens/s, K = 0 allowed, probing, hysteresis; its decisions
  (:mod:`~specdec.control.k_decision`), feedback (:mod:`~specdec.control.controller_feedback`)
  and snapshot (:mod:`~specdec.control.controller_snapshot`).
- :mod:`~specdec.control.objective`: what it maximises: expected tokens per step and per second
  for each K (or cap of a variable-length proposer) under the measured costs.
- :mod:`~specdec.control.batch_k`: K per tenant under load (continuous batching): the batch cost
  model (verify by rows and positions, batched draft forwards) and the K that maximises the
  whole batch's tokens/s within fair shares of the positions budget; its parts
  :mod:`~specdec.control.batch_cost`, :mod:`~specdec.control.batch_choice`,
  :mod:`~specdec.control.batch_controller`, :mod:`~specdec.control.goodput_guard`,
  :mod:`~specdec.control.batch_sessions`, :mod:`~specdec.control.batch_exchange`.
- :mod:`~specdec.control.adaptive`: running a generation with timing, feeding the controller,
  cost calibration.
- :mod:`~specdec.control.tenants`: tenant config, hashed API keys
  (``python -m specdec.control.tenants new-key``).
- :mod:`~specdec.control.limits`: rate limits and fair admission.

What runs per step is in :mod:`specdec.engine`.
"""
