"""``specdec bench --adaptive W[,W...]``: our engine with the per-tenant K controller, as a server
runs it, as a method of the in-process bench.

A server (:mod:`deployments.tenancy`, :mod:`deployments.controller_actor`) keeps one
:class:`specdec.control.controller.KController` (acceptance estimator with
:data:`specdec.control.acceptance.GLOBAL_PRIOR_WEIGHT`) for all tenants; per request it calls
``decide(tenant, "draft", policy, requested_k)``, runs the request with the decided K (a probe:
K for its first steps, then plain decoding; :func:`apply_decision`) and
feeds the finished request back with ``record(tenant, "draft", stats, step costs)``. As a
served draft replica calibrates its costs at start-up, the bench measures the draft's and the
target's step costs at every K once, untimed, when it first needs a controller
(:func:`specdec.control.adaptive.calibrate` with ``blocks``), and every controller starts from
those measurements (:func:`new_controller`'s ``costs``); acceptance starts from the priors. Its steps run under the tenant's
in-request goodput guard (:meth:`KController.guarded_k`), the in-process counterpart of the draft
replica's guard: speculation that measures slower than plain decoding is held at K = 0.

Here the tenant is the prompt's type (``code``, ``copy``, ``creative``, ...). What the controller
learned before a timed run is part of the method, so it is in its label:

- ``ours-adaptive-w0`` (cold): a fresh controller for every timed run; the decision comes from
  the priors alone (a fresh server's first request of that tenant);
- ``ours-adaptive-wN``: a controller taught by N earlier requests of the same prompt type
  (:data:`WARM_PROMPTS`, other prompts than the timed ones, each ``--tokens`` long, untimed),
  copied (``copy.deepcopy``) before every timed run, so every timed run of the method starts
  from the same learned state and no run gains from an earlier timed run.

The timed call covers ``decide``, the generation and nothing else (``record`` comes after the
answer, as in a server).
"""

from __future__ import annotations

import copy

#: the tenant's K range (the served default policy: K in 0..8, adaptive)
POLICY = {"k_min": 0, "k_max": 8, "adaptive": True, "fixed_k": None}

#: pseudo-trials of the per-position acceptance (:class:`KController`'s ``position_prior_trials``)
POSITION_PRIOR_TRIALS = 4.0
#: trials of the tenant's history a running request's own counts are weighed against
#: (:class:`KController`'s ``retune_memory_trials``)
RETUNE_MEMORY_TRIALS = 16.0

#: earlier requests of each prompt type that teach a warmed controller (never the timed prompts)
WARM_PROMPTS: dict[str, list[str]] = {
    "code": [
        "Write a Python function `word_count(text: str) -> dict[str, int]` that counts how often each word "
        "occurs, case-insensitively. Include a docstring.",
        "Write a Python class `Stack` with methods push, pop, peek and is_empty, with type hints and docstrings.",
        "Write a Python function `fibonacci(n: int) -> list[int]` that returns the first n Fibonacci numbers. "
        "Include a docstring.",
        "Write a Python function `flatten(nested: list) -> list` that flattens arbitrarily nested lists. "
        "Include type hints and a docstring.",
    ],
    "sql_json": [
        "Return only a JSON object for a user profile with the fields id, name, email, roles (a list) and "
        "address (an object with street, city and zip).",
        "Write an SQL query that returns the number of orders per month in 2022 from the table "
        "orders(id, customer_id, total, created_at).",
        "Return only a JSON object describing a movie with the fields title, director, year, cast (a list "
        "of strings) and rating.",
        "Write an SQL query that lists the products that were never ordered, given the tables "
        "products(id, name) and order_items(order_id, product_id, quantity).",
    ],
    "creative": [
        "Tell the beginning of a surprising story about a lighthouse keeper who finds a door in the rock.",
        "Write a whimsical poem about a cat who wants to become the moon.",
        "Begin a dreamlike short story set in a city where it rains upward.",
        "Write a poem about autumn from the point of view of an old oak tree.",
    ],
}


def _copy_prompts() -> list[str]:
    from benchmarks.inprocess_prompts import RENAME_SOURCE

    block = "\n\n```python\n" + RENAME_SOURCE + "```"
    return [f"Rewrite this Python code with {what} renamed to {new} everywhere. Return only the code." + block
            for what, new in (("the function `print_receipt`", "`show_receipt`"), ("the class `Item`", "`Product`"),
                              ("the parameter `discount`", "`rebate`"), ("the field `quantity`", "`count`"))]


def warm_prompts(prompt_type: str) -> list[str]:
    """The warm-up prompts of a prompt type (``copy``: the bench's code block with other renames).

    Raises:
        ValueError: a type without warm-up prompts.
    """
    if prompt_type == "copy":
        return _copy_prompts()
    if prompt_type not in WARM_PROMPTS:
        raise ValueError(f"no warm-up prompts for prompt type {prompt_type!r}")
    return WARM_PROMPTS[prompt_type]


def new_controller(costs: dict | None = None):
    """A controller as a fresh server builds it (:class:`deployments.controller_actor.SharedTenantState`),
    with the in-request goodput guard (:func:`specdec.control.step_guard.in_request_guard`) in
    place of the draft replica's per-tenant guard a server has, learning early-stop hazards
    from the block lengths (in process a block is shorter than the K decided only when the
    draft stopped it; blocks cut by the room left are marked, :func:`run_adaptive`). ``costs``:
    the draft proposer's measured costs to start from
    (:meth:`specdec.control.cost_model.CostModel.export_observations`), or None (priors)."""
    from specdec.control.acceptance import GLOBAL_PRIOR_WEIGHT, AcceptanceEstimator
    from specdec.control.controller import KController
    from specdec.control.step_guard import in_request_guard

    ctl = KController(estimator=AcceptanceEstimator(global_prior_weight=GLOBAL_PRIOR_WEIGHT),
                      step_guard=in_request_guard(), learn_early_stop=True, in_request_retune=True,
                      position_prior_trials=POSITION_PRIOR_TRIALS, retune_memory_trials=RETUNE_MEMORY_TRIALS,
                      fresh_key_whole_probe=True)
    if costs is not None:
        ctl.cost_model("draft").import_observations(costs)
    return ctl


def calibrated_costs(engine, encode=None) -> dict:
    """The draft proposer's step costs at every K in 0..:data:`POLICY` k_max, measured once on
    ``engine`` (:func:`specdec.control.adaptive.calibrate`, ``blocks=True``, 3 repeats, its
    default code prompt), as :meth:`CostModel.export_observations` data."""
    import torch

    from specdec.control.adaptive import calibrate

    ctl = new_controller()
    with torch.inference_mode():
        calibrate(engine, ctl, max_k=POLICY["k_max"], repeats=3, blocks=True)
    return ctl.cost_model("draft").export_observations()


def apply_decision(request, decision) -> tuple[object, object]:
    """``(request', k)`` to run ``request`` with ``decision`` (a KDecision or its dict).

    At K = 0 the request's ``speculation.k`` becomes 0, so the engine opens no proposer session
    (no draft prefill); otherwise it becomes the decided K and ``k`` is
    :meth:`KDecision.k_schedule` (a callable for a step-limited probe).
    """
    from specdec.control.controller import k_schedule

    if isinstance(decision, dict):
        k = int(decision["k"])
        steps = decision.get("probe_steps") if decision.get("probe") else None
    else:
        k = int(decision.k)
        steps = decision.probe_steps if decision.probe else None
    spec = request.speculation.model_copy(update={"k": k})
    req = request.model_copy(update={"speculation": spec})
    return req, (k_schedule(k, steps) if k > 0 else 0)


def run_adaptive(engine, controller, tenant: str, prompt_ids: list[int], tokens: int, min_confidence: float = 0.0):
    """One request of ``tenant`` decided by ``controller``, run, then recorded into it.

    Returns:
        ``(TimedRun, KDecision)``; the caller times the call of this function and calls
        :func:`record` after it.
    """
    from specdec.control.adaptive import run_timed
    from specdec.request import GenerationRequest

    base = GenerationRequest(prompt_token_ids=list(prompt_ids), max_tokens=tokens,
                             speculation={"proposer": "draft", "k": POLICY["k_max"],
                                          "draft_min_confidence": min_confidence})
    decision = controller.decide(tenant, "draft", POLICY, requested_k=POLICY["k_max"], tokens=tokens)
    req, k = apply_decision(base, decision)
    if decision.k > 0:  # per step: the decided K unless the tenant's goodput guard forces K = 0
        k = controller.guarded_k(tenant, "draft", decision)
    gen = engine.start(req, k=k)
    if decision.k > 0:
        k.attach(gen.stats)
    timed = run_timed(gen, max_tokens=tokens)
    return timed, decision


def record(controller, tenant: str, timed) -> None:
    """Feed a finished request back (after the answer, as a server does)."""
    controller.record(tenant, "draft", timed.result.stats, timed.costs.as_dict())


class AdaptiveState:
    """The learned controllers of the ``ours-adaptive-w<N>`` methods, one per (N, tenant).

    Args:
        engine: the bench's :class:`specdec.engine.engine.SpeculativeEngine`.
        encode: ``text -> prompt ids`` (the bench's chat template).
    """

    def __init__(self, engine, encode):
        self.engine = engine
        self.encode = encode
        self._taught: dict[tuple[int, str, float], object] = {}
        #: the calibrated costs every controller starts from (:func:`calibrated_costs`; on first use)
        self.costs: dict | None = None
        #: (N, tenant, C) -> the decisions of the warm-up requests (k, reason, alpha)
        self.warm_log: dict[str, list[dict]] = {}

    def controller(self, warm: int, tenant: str, tokens: int, min_confidence: float):
        """A controller for one timed run: fresh (``warm`` = 0) or a copy of one taught by ``warm``
        warm-up requests of ``tenant``, ``tokens`` new tokens each (taught once, on first use)."""
        if self.costs is None:
            self.costs = calibrated_costs(self.engine)
        if warm == 0:
            return new_controller(self.costs)
        key = (warm, tenant, min_confidence)
        if key not in self._taught:
            ctl = new_controller(self.costs)
            prompts = warm_prompts(tenant)
            log = []
            for i in range(warm):
                ids = self.encode(prompts[i % len(prompts)])
                timed, d = run_adaptive(self.engine, ctl, tenant, ids, tokens, min_confidence)
                record(ctl, tenant, timed)
                log.append({"k": d.k, "reason": d.reason, "alpha": d.alpha, "probe": d.probe,
                            "k_counts": {int(a): b for a, b in timed.result.stats.k_counts.items()}})
            self._taught[key] = ctl
            self.warm_log[f"w{warm}/{tenant}/c{min_confidence:g}"] = log
        return copy.deepcopy(self._taught[key])
