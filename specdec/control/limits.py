"""Per-tenant rate limits and fair admission (pure Python + asyncio; no Ray, no gRPC).

:class:`RateLimiter` enforces a tenant's ``tokens_per_minute`` (token bucket) and
``max_concurrent_requests`` (counter), raising :class:`ResourceExhaustedError` that names the
limit and says when to retry. :class:`FairAdmission` shares the server's request slots
between tenants so that a burst from one tenant does not starve another.

A router does, per request::

    lease = limiter.acquire(tenant, prompt_tokens + max_tokens)      # may raise
    try:
        async with admission.slot(tenant.id):                      # may wait, or raise
            result = await generate(...)
    finally:
        lease.release(used_tokens=prompt_tokens + result.usage.completion_tokens)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from specdec.errors import ResourceExhaustedError


@dataclass
class _Bucket:
    level: float
    updated: float


@dataclass
class RateLease:
    """What :meth:`RateLimiter.acquire` reserved; give it back with :meth:`release`."""

    limiter: "RateLimiter"
    tenant_id: str
    reserved_tokens: int
    released: bool = field(default=False)

    def release(self, used_tokens: int | None = None) -> None:
        """End the request: free its concurrency slot and refund ``reserved - used`` tokens.

        ``used_tokens=None`` keeps the whole reservation charged. Idempotent.
        """
        if self.released:
            return
        self.released = True
        self.limiter._release(self, used_tokens)


class RateLimiter:
    """Token bucket (tokens per minute) and concurrency counter per tenant.

    The bucket holds at most ``tokens_per_minute`` tokens (a burst of one minute) and refills
    at ``tokens_per_minute / 60`` tokens per second. A request reserves ``prompt + max_tokens``
    up front (it cannot know its length in advance) and the unused part is refunded on
    release. Concurrency counts requests between ``acquire`` and ``release``.

    Args:
        clock: monotonic seconds (injectable for tests).
        concurrency_retry_after_s: the ``retry_after_s`` hint given when the concurrency limit
            fires (when a slot frees is unknown in advance).

    Tenants are duck-typed: anything with ``.id`` and ``.limits`` (``tokens_per_minute``,
    ``max_concurrent_requests``), e.g. :class:`specdec.control.tenants.Tenant`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, concurrency_retry_after_s: float = 1.0):
        self.clock = clock
        self.concurrency_retry_after_s = concurrency_retry_after_s
        self._buckets: dict[str, _Bucket] = {}
        self._active: dict[str, int] = collections.defaultdict(int)

    def _level(self, tenant_id: str, tpm: int, now: float) -> _Bucket:
        b = self._buckets.get(tenant_id)
        if b is None:
            b = self._buckets[tenant_id] = _Bucket(level=float(tpm), updated=now)
        else:
            b.level = min(float(tpm), b.level + (now - b.updated) * tpm / 60.0)
            b.updated = now
        return b

    def available_tokens(self, tenant) -> float | None:
        """Tokens in the tenant's bucket now (None when tokens_per_minute is unlimited)."""
        tpm = tenant.limits.tokens_per_minute
        if tpm is None:
            return None
        return self._level(tenant.id, tpm, self.clock()).level

    def active(self, tenant_id: str) -> int:
        """Requests of the tenant between acquire and release."""
        return self._active.get(tenant_id, 0)

    def acquire(self, tenant, tokens: int) -> RateLease:
        """Reserve one concurrency slot and ``tokens`` tokens for a request, or raise.

        Raises:
            ResourceExhaustedError: ``limit="max_concurrent_requests"`` with the retry hint;
                ``limit="tokens_per_minute"`` with ``retry_after_s`` = seconds until the bucket
                holds ``tokens`` (exact under a steady clock), or None if ``tokens`` exceeds
                the bucket's size (the request can never pass; lower max_tokens).
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        lim = tenant.limits
        if self._active.get(tenant.id, 0) >= lim.max_concurrent_requests:
            raise ResourceExhaustedError(
                f"tenant {tenant.id!r} already has {lim.max_concurrent_requests} requests in flight "
                f"(limit max_concurrent_requests); retry when one finishes",
                limit="max_concurrent_requests",
                retry_after_s=self.concurrency_retry_after_s,
            )
        tpm = lim.tokens_per_minute
        if tpm is not None:
            b = self._level(tenant.id, tpm, self.clock())
            if tokens > tpm:
                raise ResourceExhaustedError(
                    f"request needs {tokens} tokens (prompt + max_tokens) but tenant {tenant.id!r} "
                    f"may use at most {tpm} per minute (limit tokens_per_minute); lower max_tokens",
                    limit="tokens_per_minute",
                    retry_after_s=None,
                )
            if tokens > b.level:
                wait = (tokens - b.level) * 60.0 / tpm
                raise ResourceExhaustedError(
                    f"tenant {tenant.id!r} is over its limit of {tpm} tokens per minute "
                    f"(limit tokens_per_minute): request needs {tokens}, {int(b.level)} available; "
                    f"retry after {wait:.3f} s",
                    limit="tokens_per_minute",
                    retry_after_s=wait,
                )
            b.level -= tokens
        self._active[tenant.id] += 1
        return RateLease(limiter=self, tenant_id=tenant.id, reserved_tokens=tokens)

    def _release(self, lease: RateLease, used_tokens: int | None) -> None:
        self._active[lease.tenant_id] = max(0, self._active.get(lease.tenant_id, 0) - 1)
        if used_tokens is None:
            return
        refund = lease.reserved_tokens - max(0, used_tokens)
        b = self._buckets.get(lease.tenant_id)
        if refund > 0 and b is not None:
            b.level += refund  # capped at the bucket size on the next read


class FairAdmission:
    """Admission of requests into ``capacity`` shared slots, by tenant rather than FIFO.

    Each tenant has its own FIFO queue, at most ``max_queue_per_tenant`` long. When a slot
    frees, it goes to the waiting tenant holding the fewest slots relative to its weight
    (``running / weight``), ties to the tenant served least recently (round robin). This is
    the max-min fair ("water-filling") share of slots: a tenant with a burst of 20 queued does
    not delay another tenant's single request beyond the next free slot, and weights give
    proportional shares under contention. Requests are the unit (not tokens); per-tenant token
    rates are the :class:`RateLimiter`'s job.

    Use from one event loop::

        async with admission.slot("acme"):
            ...

    A waiter cancelled while queued leaves its queue; one cancelled just after being granted
    gives its slot back.
    """

    def __init__(
        self,
        capacity: int,
        max_queue_per_tenant: int = 64,
        weights: dict[str, float] | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_queue_per_tenant < 0:
            raise ValueError(f"max_queue_per_tenant must be >= 0, got {max_queue_per_tenant}")
        self.capacity = capacity
        self.max_queue_per_tenant = max_queue_per_tenant
        self.weights = dict(weights or {})
        for t, w in self.weights.items():
            if not w > 0:
                raise ValueError(f"weight of {t!r} must be > 0, got {w}")
        self._running: dict[str, int] = collections.defaultdict(int)
        self._queues: dict[str, collections.deque[asyncio.Future]] = {}
        self._last_served: dict[str, int] = {}
        self._seq = 0
        self.admitted_order: list[str] = []  # tenant ids in grant order (bounded, for tests/metrics)

    # ------------------------------------------------------------------ views

    @property
    def running(self) -> int:
        return sum(self._running.values())

    def running_for(self, tenant_id: str) -> int:
        return self._running.get(tenant_id, 0)

    def queued(self, tenant_id: str | None = None) -> int:
        if tenant_id is not None:
            return len(self._queues.get(tenant_id, ()))
        return sum(len(q) for q in self._queues.values())

    # ------------------------------------------------------------------ slots

    @contextlib.asynccontextmanager
    async def slot(self, tenant_id: str) -> AsyncIterator[None]:
        """Hold one slot for ``tenant_id`` for the body of the ``async with``."""
        await self.acquire(tenant_id)
        try:
            yield
        finally:
            self.release(tenant_id)

    async def acquire(self, tenant_id: str) -> None:
        """Wait for a slot. Raises ResourceExhaustedError if the tenant's queue is full."""
        if self.running < self.capacity and not any(self._queues.values()):
            self._grant(tenant_id)
            return
        q = self._queues.setdefault(tenant_id, collections.deque())
        if len(q) >= self.max_queue_per_tenant:
            raise ResourceExhaustedError(
                f"tenant {tenant_id!r} already has {len(q)} requests queued "
                f"(limit max_queued_requests={self.max_queue_per_tenant}); retry shortly",
                limit="max_queued_requests",
                retry_after_s=1.0,
            )
        fut = asyncio.get_running_loop().create_future()
        q.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # Granted, then cancelled before resuming: hand the slot on.
                self.release(tenant_id)
            else:
                with contextlib.suppress(ValueError):
                    q.remove(fut)
            raise

    def release(self, tenant_id: str) -> None:
        """Give back one slot of ``tenant_id`` and grant free slots to waiting tenants."""
        if self._running.get(tenant_id, 0) <= 0:
            raise RuntimeError(f"release without a slot for tenant {tenant_id!r}")
        self._running[tenant_id] -= 1
        self._dispatch()

    def _grant(self, tenant_id: str) -> None:
        self._running[tenant_id] += 1
        self._seq += 1
        self._last_served[tenant_id] = self._seq
        self.admitted_order.append(tenant_id)
        if len(self.admitted_order) > 10_000:
            del self.admitted_order[:5_000]

    def _dispatch(self) -> None:
        while self.running < self.capacity:
            waiting = [t for t, q in self._queues.items() if q]
            if not waiting:
                return
            t = min(
                waiting,
                key=lambda t: (self._running.get(t, 0) / self.weights.get(t, 1.0), self._last_served.get(t, 0)),
            )
            fut = self._queues[t].popleft()
            if fut.cancelled():
                continue
            self._grant(t)
            fut.set_result(None)
