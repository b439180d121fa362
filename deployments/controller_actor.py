"""Per-tenant state shared by every router and draft replica of one Serve application and model
pair: one K controller, rate limits, usage, the draft replicas' acceptance pool.

With autoscaled router replicas, each replica must use the same per-tenant acceptance estimate
and cost model (else each replica learns alone, from 1/N of the traffic), and a tenant's
``tokens_per_minute`` and ``max_concurrent_requests`` must hold across replicas (else N replicas
allow N times the limit). So that state lives in one place:

- :class:`SharedTenantState`: plain Python: a :class:`specdec.control.controller.KController`, a
  :class:`specdec.control.limits.RateLimiter` with leases by id, and cumulative usage per tenant.
  Methods take and return plain data (str, int, float, dict), so they cross a Ray actor call.
- the Ray actor of that class (:func:`deployments.controller_client.get_or_create_actor`): named
  per application and model pair (:func:`actor_name` of ``AppConfig.app_name`` and
  ``AppConfig.model_pair()``, in namespace :data:`ACTOR_NAMESPACE`), ``lifetime="detached"`` (no router replica owns it: replicas come
  and go with autoscaling, the estimates stay), ``num_cpus=0``, ``get_if_exists=True`` (the first
  replica creates it, the others attach), ``max_concurrency=1`` (calls are serialized: the
  controller is not thread-safe), ``allow_out_of_order_execution=True`` (a call runs when it
  arrives, not after the caller's earlier calls: no call depends on another's order, and Ray's
  in-order queue waits 30 s for a call that was cancelled before it reached the actor, holding
  up every later call of that replica: a disconnect mid-stream once stalled the next request's
  admission so). Each call is a few hundred microseconds of Python.
- :class:`deployments.controller_client.ControllerClient`: what a router or draft replica holds
  (the actor's handle, or a local ``SharedTenantState`` without Ray, with the fallback when the
  actor does not answer), in its own module.

One actor per application and model pair, not per cluster: what it holds is the traffic of one
application's tenants against its draft/target pair, its limits and its settings. Two
applications in one Ray cluster (two model pairs, or the batched and unbatched applications that
``benchmarks/served_clients.py`` deploys side by side) once shared a single actor: each pooled
the other's acceptance counts (a batched application at K = 0 saw its tenant's alpha fall from
0.79 to 0.57 with the other application's K = 4 steps of other prompts), its per-request K
controller, cost models, limits, leases and usage, and the first application's
``controller_kwargs`` held for both. The pair is in the name (a short hash of it,
:func:`pair_hash`) because the actor is detached and its replicas attach to it
(``get_if_exists``): an application redeployed under the same name with another pair would
otherwise attach to the live actor of the old pair and inherit its acceptance, cost models and K
(its ``pair`` argument ignored). With the pair in the name the new pair's replicas create their
own actor, and during a rolling update the old replicas keep theirs: nothing flips between the
two. Its snapshot key (:func:`snapshot_key`) is per application and pair too. Consequences: the
usage counters that ``GetTenantStats`` reports are the actor's, so they restart at zero with a
new pair (the Prometheus counters are the durable ones); an actor of a pair no longer deployed
stays (0 CPUs, idle) with its snapshot key until it is killed
(``ray.kill(ray.get_actor(name, namespace="specdec"))``) or the cluster restarts; state saved
before the pair was in the name (keys ``specdec-k-controller/snapshot``,
``specdec-k-controller:<app_name>/snapshot``) is not read: an upgrade starts learning afresh.

Per request a router makes two calls: :meth:`SharedTenantState.admit` (rate limits + K decision,
one round trip) and :meth:`SharedTenantState.complete` (release + feedback + usage). A request
whose K the draft replica chooses per step (``batch_adaptive``: K under load) skips the
per-request controller in both: its K and its acceptance live with the draft replicas and the
pool below, one place.

Acceptance shared by the draft replicas (K under load): each draft replica chooses every step's
K from its own batch (:class:`specdec.control.batch_k.BatchKSessions`), and the costs behind
that choice are its own (its hardware, its batch). Acceptance is not: it is the tenant's traffic
against the draft/target pair, the same on every replica, and N replicas learning it alone
would each see 1/N of the steps (and a tenant's probes on one replica would teach the others
nothing). So every ``batch_k_sync_s`` seconds a draft replica sends the steps it recorded since
its last report (:meth:`SharedTenantState.sync_batch_acceptance`) and takes back the pooled
counts of all replicas, on top of which it replays its steps since the report. The pool is a
separate :class:`specdec.control.acceptance.AcceptanceEstimator` from the per-request
controller's: that one is fed whole requests when they end (router replicas), this one per-step
counts (draft replicas); feeding one with both would count every step twice.

K under load per draft replica: the same report carries the replica's K under load per tenant
(:meth:`specdec.control.batch_k.BatchKSessions.tenant_views`); the state keeps the latest view of
every replica (for ``batch_view_ttl_s``, default 300 s, after its last report) and
:meth:`SharedTenantState.tenant_stats` lists them under ``"batch_replicas"``, so that
``GetTenantStats`` shows every replica's K, not only that of whichever replica answers a call.

Persistence: what the controller learned (acceptance estimates, cost models, K state) and the
usage counters are saved at most every ``snapshot_every_s`` (default 30 s) to a store, and
loaded when the state is created. A snapshot is versioned plain data (JSON, no pickled objects),
so it survives an upgrade that adds a field (missing fields take their defaults); one that
cannot be read is ignored with a log line and the state starts fresh. The actor uses :class:`RayKVStore` (Ray's GCS key-value
store, under its application and pair's :func:`snapshot_key`: it outlives the actor, so a restarted
controller actor resumes where it was; on KubeRay with GCS fault tolerance it also outlives the
head pod). Rate-limit buckets and leases are not saved: they belong to requests in flight.
A snapshot records the draft/target pair it was learned on (``pair``:
:meth:`deployments.config.AppConfig.model_pair`, the model specs and weight formats as
configured); a state given a pair restores only a snapshot of that same pair. The key already
names the pair, so this is a guard (a key written by hand, a hash collision): a snapshot of
another pair, or one that records none, is ignored with a log line (its acceptance and costs
belong to other models).

Leases: a lease id is a random 128-bit hex string (``uuid4``), so ids of a restarted actor,
of another incarnation and of a router's local fallback never collide; :meth:`complete` releases
a lease only for the tenant that holds it. Leases of a replica that died are never released;
each expires ``LEASE_GRACE_S`` after its request's own timeout (``timeout_s`` of :meth:`admit`;
``lease_ttl_s``, default 300 s, when the caller gives none), so a crashed replica does not hold a
tenant's concurrency forever and a long request keeps its slot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from specdec.control.acceptance import GLOBAL_PRIOR_WEIGHT, AcceptanceEstimator
from specdec.control.batch_k import merge_report
from specdec.control.controller import KController
from specdec.errors import ResourceExhaustedError
from specdec.control.limits import RateLimiter

from deployments.batch_k_stats import checked_replica_views

log = logging.getLogger(__name__)

#: Start of the shared actor's name; the application's name and its pair's hash follow (:func:`actor_name`).
ACTOR_NAME_PREFIX = "specdec-k-controller"
#: Ray namespace of every application's shared actor and of their snapshots.
ACTOR_NAMESPACE = "specdec"
#: hex digits of :func:`pair_hash` (48 bits: a collision among one application's pairs is negligible,
#: and the snapshot's own pair check guards it anyway)
PAIR_HASH_CHARS = 12
#: ``format`` of a snapshot saved by :meth:`SharedTenantState.snapshot` (its version is the controller's).
SNAPSHOT_FORMAT = "specdec-controller-snapshot"
_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens")
#: Seconds a lease outlives its request's timeout (the router's cleanup after the deadline).
LEASE_GRACE_S = 30.0


def pair_hash(pair: Mapping) -> str:
    """A short stable hash of a model pair (:meth:`deployments.config.AppConfig.model_pair`):
    the first :data:`PAIR_HASH_CHARS` hex digits of the SHA-256 of its canonical JSON (keys
    sorted, no spaces), the same in every process and Python version.

    Raises:
        ValueError: ``pair`` is not a mapping (a pair is needed: the actor is per pair).
        TypeError: ``pair`` is not plain JSON data.
    """
    if not isinstance(pair, Mapping):
        raise ValueError(f"the shared actor needs the application's model pair (a mapping), got {pair!r}")
    canonical = json.dumps(dict(pair), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:PAIR_HASH_CHARS]


def actor_name(app_name: str, pair: Mapping) -> str:
    """The name of the shared actor of the Serve application ``app_name``
    (``AppConfig.app_name``) serving the model pair ``pair`` (``AppConfig.model_pair()``): one
    actor per application and pair (module docstring).

    ``"specdec-k-controller:<app_name>:<pair_hash(pair)>"``: Ray takes any non-empty string as
    an actor's name, Serve's own actors have names such as ``SERVE_REPLICA::<app>#<deployment>#<id>``.

    Raises:
        ValueError: ``app_name`` is not a non-empty string, or ``pair`` not a mapping.
    """
    if not isinstance(app_name, str) or not app_name:
        raise ValueError(f"the shared actor needs the application's name, got {app_name!r}")
    return f"{ACTOR_NAME_PREFIX}:{app_name}:{pair_hash(pair)}"


def snapshot_key(app_name: str, pair: Mapping) -> str:
    """The GCS key-value key (in :data:`ACTOR_NAMESPACE`) of the snapshot of the shared actor of
    ``app_name`` and ``pair``: ``"<actor_name(app_name, pair)>/snapshot"``."""
    return f"{actor_name(app_name, pair)}/snapshot"


def _limits_ns(tenant_id: str, limits: Mapping) -> SimpleNamespace:
    return SimpleNamespace(
        id=tenant_id,
        limits=SimpleNamespace(
            tokens_per_minute=limits.get("tokens_per_minute"),
            max_concurrent_requests=int(limits.get("max_concurrent_requests", 1 << 30)),
        ),
    )


class RayKVStore:
    """Snapshot storage in Ray's GCS key-value store (``ray.experimental.internal_kv``).

    Args:
        key: the key (bytes of a snapshot are stored under it in :data:`ACTOR_NAMESPACE`): the
            application and pair's :func:`snapshot_key`.
    """

    def __init__(self, key: str):
        self.key = key

    def load(self) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(self.key, namespace=ACTOR_NAMESPACE)

    def save(self, blob: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.key, blob, overwrite=True, namespace=ACTOR_NAMESPACE)


class SharedTenantState:
    """The shared per-tenant state (see module docstring). Not thread-safe: one owner.

    Args:
        controller_kwargs: keyword arguments of :class:`KController` (plain data).
        lease_ttl_s: a lease of a request admitted without a timeout is released, as if its
            request had ended, after this many seconds.
        clock: monotonic seconds (tests inject one; also used by the controller when given).
        store: where snapshots go (``load() -> bytes | None``, ``save(bytes)``); None: none.
        snapshot_every_s: least time between two snapshots (saved after a request completes).
        batch_view_ttl_s: a draft replica's K-under-load view is dropped this many seconds
            after its last report (a replica gone, or idle: its K is no longer current).
        pair: what identifies the draft/target pair (plain data,
            :meth:`deployments.config.AppConfig.model_pair`): saved in every snapshot, and only
            a snapshot of the same pair is restored (module docstring). None: not checked, and
            not recorded (tests, a state without an application).
    """

    def __init__(
        self,
        controller_kwargs: Mapping | None = None,
        lease_ttl_s: float = 300.0,
        clock: Callable[[], float] | None = None,
        store: Any = None,
        snapshot_every_s: float = 30.0,
        batch_view_ttl_s: float = 300.0,
        pair: Mapping | None = None,
    ):
        kw = dict(controller_kwargs or {})
        self.clock = clock or time.monotonic
        if clock is not None:
            kw.setdefault("clock", clock)
        kw.setdefault("estimator", AcceptanceEstimator(global_prior_weight=GLOBAL_PRIOR_WEIGHT))
        self.controller = KController(**kw)
        #: acceptance counts of the draft replicas' steps, pooled (module docstring)
        self.batch_acceptance = AcceptanceEstimator(global_prior_weight=GLOBAL_PRIOR_WEIGHT)
        #: draft replica id -> clock of its last report
        self.batch_replicas: dict[str, float] = {}
        #: draft replica id -> {tenant: its K under load there} as of that report
        self.batch_views: dict[str, dict[str, dict]] = {}
        self.batch_view_ttl_s = float(batch_view_ttl_s)
        self.limiter = RateLimiter(clock=self.clock)
        self.lease_ttl_s = lease_ttl_s
        #: lease id -> (RateLease, monotonic time after which it expires)
        self._leases: dict[str, tuple[Any, float]] = {}
        self.usage: dict[str, dict[str, int]] = {}
        self.store = store
        self.snapshot_every_s = snapshot_every_s
        #: the draft/target pair (None: unchecked); JSON-normalised to compare with a snapshot's
        self.pair = None if pair is None else json.loads(json.dumps(dict(pair), sort_keys=True))
        self._saved_at: float | None = None
        self.restored = self._restore()

    # ------------------------------------------------------------------ persistence

    def _restore(self) -> bool:
        """Load the last snapshot from the store, if any; True when one was applied.

        A snapshot that cannot be read (not JSON, another version, another shape) is ignored
        with one log line: the state starts fresh rather than failing every request. So is, when
        this state has a ``pair``, a snapshot of another pair or of none (written before
        snapshots recorded it): what it learned belongs to other models."""
        if self.store is None:
            return False
        try:
            blob = self.store.load()
        except Exception:
            log.warning("could not read the controller snapshot; starting fresh", exc_info=True)
            return False
        if not blob:
            return False
        try:
            data = json.loads(blob)
            if not isinstance(data, dict) or data.get("format") != SNAPSHOT_FORMAT:
                raise ValueError("not a specdec controller snapshot")
            if self.pair is not None and data.get("pair") != self.pair:
                log.warning("controller snapshot ignored: %s; starting fresh",
                            "it records no model pair (written before snapshots did)" if "pair" not in data
                            else f"learned on the pair {data['pair']}, this application serves {self.pair}")
                return False
            usage = {
                str(t): {f: int(u.get(f, 0)) for f in _USAGE_FIELDS} for t, u in dict(data["usage"]).items()
            }
            self.controller.import_learned(data["controller"])
            if "batch_acceptance" in data:  # absent in snapshots written before it existed
                pool = AcceptanceEstimator(global_prior_weight=GLOBAL_PRIOR_WEIGHT)
                pool.import_counts(data["batch_acceptance"])
                self.batch_acceptance = pool
        except Exception as e:
            log.warning("controller snapshot unreadable (%s: %s); starting fresh", type(e).__name__, e)
            return False
        self.usage = usage
        log.info("controller state restored: %d tenant/proposer keys", len(self.controller._state))
        return True

    def snapshot(self, force: bool = False) -> bool:
        """Save the learned state and usage now (``force``) or if ``snapshot_every_s`` passed
        since the last save; True when saved. Storage errors are logged, never raised.

        The snapshot is JSON: ``{"format": SNAPSHOT_FORMAT, "controller":
        KController.export_learned() (versioned), "usage": {tenant: counters},
        "batch_acceptance": the pool's counts, "pair": the model pair}`` (``pair`` only when
        this state has one)."""
        if self.store is None:
            return False
        now = self.clock()
        if not force and self._saved_at is not None and now - self._saved_at < self.snapshot_every_s:
            return False
        try:
            data = {"format": SNAPSHOT_FORMAT, "controller": self.controller.export_learned(),
                    "usage": self.usage, "batch_acceptance": self.batch_acceptance.export_counts()}
            if self.pair is not None:
                data["pair"] = self.pair
            blob = json.dumps(data, separators=(",", ":")).encode()
            self.store.save(blob)
        except Exception:
            log.warning("could not save the controller snapshot", exc_info=True)
            return False
        self._saved_at = now
        return True

    # ------------------------------------------------------------------ per request

    def admit(
        self,
        tenant_id: str,
        limits: Mapping,
        tokens: int,
        proposer: str,
        policy: Mapping,
        requested_k: int | None,
        timeout_s: float | None = None,
        batch_adaptive: bool = False,
    ) -> dict:
        """Reserve rate limits for one request and decide its K, in one call.

        Args:
            timeout_s: the request's own time budget in seconds; its lease expires
                ``LEASE_GRACE_S`` after it (None: after ``lease_ttl_s``).
            batch_adaptive: the request's K is chosen per step by the draft replica's batch
                controller (K under load): the per-request controller is not asked; the
                decision is :func:`batch_decision` (K = ``requested_k``, the ceiling).

        Returns:
            ``{"lease": id (str), "decision": KDecision dict}``, or ``{"error": {"message",
            "limit", "retry_after_s"}}`` when a limit fires (errors travel as data: Ray would
            wrap the exception and drop its attributes).
        """
        self._expire()
        try:
            lease = self.limiter.acquire(_limits_ns(tenant_id, limits), int(tokens))
        except ResourceExhaustedError as e:
            return {"error": {"message": str(e), "limit": e.limit, "retry_after_s": e.retry_after_s}}
        lease_id = uuid.uuid4().hex
        ttl = self.lease_ttl_s if timeout_s is None else float(timeout_s) + LEASE_GRACE_S
        self._leases[lease_id] = (lease, self.clock() + ttl)
        u = self.usage.setdefault(tenant_id, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
        u["requests"] += 1
        if batch_adaptive:
            return {"lease": lease_id, "decision": batch_decision(tenant_id, proposer, int(requested_k or 0))}
        return {"lease": lease_id, "decision": self.decide(tenant_id, proposer, policy, requested_k)}

    def complete(
        self,
        lease_id: str | None,
        tenant_id: str,
        proposer: str,
        stats: Mapping | None = None,
        costs: Mapping | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        used_tokens: int | None = None,
        batch_adaptive: bool = False,
    ) -> None:
        """End one admitted request: release its lease (refunding unused tokens), feed its
        stats (if any steps ran) to the controller and add its usage. Idempotent per lease.
        A ``batch_adaptive`` request's stats are not fed to the per-request controller: its
        steps reach the acceptance pool of the draft replicas (:meth:`sync_batch_acceptance`),
        which chose its K; feeding both would count them twice in two places.

        A lease this state does not hold (admitted by a previous incarnation, expired) or held
        by another tenant is not released (logged); the usage and feedback still count."""
        entry = self._leases.get(lease_id) if lease_id is not None else None
        if entry is not None and entry[0].tenant_id != tenant_id:
            log.warning("lease %s belongs to tenant %r, not %r: not released", lease_id, entry[0].tenant_id, tenant_id)
            return
        if entry is not None:
            del self._leases[lease_id]
            entry[0].release(used_tokens)
        u = self.usage.setdefault(tenant_id, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
        u["prompt_tokens"] += int(prompt_tokens)
        u["completion_tokens"] += int(completion_tokens)
        if stats and int(stats.get("steps", 0)) > 0 and not batch_adaptive:
            self.record(tenant_id, proposer, stats, costs)
        self.snapshot()

    def _expire(self) -> None:
        now = self.clock()
        for lid, (lease, expires) in list(self._leases.items()):
            if now > expires:
                log.warning("lease %s of tenant %r expired (its request's timeout passed)", lid, lease.tenant_id)
                lease.release(None)
                del self._leases[lid]

    # ------------------------------------------------------------------ controller API

    def decide(self, tenant: str, proposer: str, policy: Mapping, requested_k: int | None = None) -> dict:
        """:meth:`KController.decide` as a dict (``candidates`` included)."""
        return self.controller.decide(tenant, proposer, dict(policy), requested_k).as_dict()

    def record(self, tenant: str, proposer: str, stats: Mapping, costs: Mapping | None = None) -> None:
        self.controller.record(tenant, proposer, dict(stats), costs)

    def observe_step(
        self, proposer: str, k: int, draft_s: float, verify_s: float, round_trip_s: float | None = None
    ) -> None:
        self.controller.observe_step(proposer, k, draft_s, verify_s, round_trip_s)

    def current_k(self, tenant: str, proposer: str) -> int | None:
        return self.controller.current_k(tenant, proposer)

    def sync_batch_acceptance(self, replica: str, report: Mapping) -> dict:
        """Merge one draft replica's steps since its last report into the pool and return the
        pool (module docstring).

        Args:
            replica: the draft replica's id (for :attr:`batch_replicas`).
            report: :meth:`specdec.control.batch_k.BatchKSessions.take_sync_report`.

        Returns:
            the pool's counts, :meth:`AcceptanceEstimator.export_counts` (all tenants).

        Raises:
            ValueError: a malformed report (nothing merged).
        """
        views = checked_replica_views(report.get("tenants") or {})
        merge_report(self.batch_acceptance, dict(report))
        self.batch_replicas[str(replica)] = self.clock()
        if "tenants" in report:
            self.batch_views[str(replica)] = views
        self.snapshot()
        return self.batch_acceptance.export_counts()

    def tenant_stats(self, tenant: str) -> dict:
        """One tenant's view: per proposer its controller state (α̂, counts, K, last decision
        with cost terms and predicted speedup) and the proposer's cost model, and under
        ``"batch_acceptance"`` the counts pooled from the draft replicas' steps (K under load)
        when there are any; its usage; every draft replica's K under load
        (``"batch_replicas"``, :meth:`batch_k_views`)."""
        per = self.controller.tenant_stats(tenant)
        for proposer, d in per.items():
            d["cost_model"] = self.controller.cost_model(proposer).snapshot()
        for t, proposer in self.batch_acceptance.keys():
            if t == tenant and self.batch_acceptance.raw_steps((t, proposer)) > 0:
                per.setdefault(proposer, {})["batch_acceptance"] = self.batch_acceptance.snapshot((t, proposer)).as_dict()
        return {
            "tenant_id": tenant,
            "proposers": per,
            "usage": dict(self.usage.get(tenant, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})),
            "batch_replicas": self.batch_k_views(tenant),
        }

    def batch_k_views(self, tenant: str) -> list[dict]:
        """``tenant``'s K under load on every draft replica that reported it within
        ``batch_view_ttl_s``: :meth:`BatchKSessions.tenant_views` entries plus ``"replica"`` (its
        id) and ``"reported_s_ago"`` (seconds since its report), most recent report first."""
        now = self.clock()
        for r, at in list(self.batch_replicas.items()):
            if now - at > self.batch_view_ttl_s:
                self.batch_views.pop(r, None)
        out = []
        for r, views in self.batch_views.items():
            v = views.get(tenant)
            if v is not None:
                out.append(dict(v, replica=r, reported_s_ago=max(0.0, now - self.batch_replicas[r])))
        return sorted(out, key=lambda v: (v["reported_s_ago"], v["replica"]))

    def batch_k_replicas(self) -> dict[str, float]:
        """Draft replica id -> clock of its last acceptance report (:meth:`sync_batch_acceptance`)."""
        return dict(self.batch_replicas)

    def active_leases(self) -> int:
        return len(self._leases)

    def holds_lease(self, lease_id: str | None) -> bool:
        """Whether ``lease_id`` is one of this state's open leases."""
        return lease_id in self._leases

    def was_restored(self) -> bool:
        """True when this state started from a saved snapshot (e.g. after an actor restart)."""
        return self.restored

    def ping(self) -> str:
        return "ok"


def batch_decision(tenant: str, proposer: str, k_cap: int) -> dict:
    """The admission decision of a request whose K the draft replica's batch controller chooses
    per step (K under load): no per-request choice, ``k`` is the request's ceiling.

    Returns:
        ``{"tenant", "proposer", "k": k_cap, "reason": "K under load", "batch": True,
        "probe": False, "probe_steps": None}``.
    """
    return {"tenant": tenant, "proposer": proposer, "k": int(k_cap), "reason": "K under load", "batch": True,
            "probe": False, "probe_steps": None}
