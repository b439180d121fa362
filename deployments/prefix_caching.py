"""Automatic prefix caching of the served models (``AppConfig.prefix_cache_entries``).

The target's every TP rank (:meth:`deployments.tp_worker.TPWorker.setup`) and the draft replica
(:class:`deployments.draft.Draft`) attach a :class:`specdec.engine.prefix_cache.PrefixCache` to
their model when it is shape-invariant (every weight format but float32): a new session's KV
cache then starts from the longest committed prefix another session of the same model holds
(open, or one of the last ``entries`` closed ones), e.g. the chat template's opening, or the
whole previous turn of a conversation, instead of computing it; outputs are unchanged.

The TP ranks copy the same positions: every rank opens, steps and closes the same sessions in
the same order (the Target replica fans each call out to all ranks, :func:`deployments.tp_worker.call_all`;
a rank's default concurrency group runs them one at a time), and a copy decision depends only on
that sequence of calls. A draft replica without ``draft_batching`` feeds its sessions from
several threads at once, so it copies only from closed sessions there (``live=False``).

Scopes (``AppConfig.prefix_cache_scope``): under "tenant" (the default) the draft replica opens
each generation's draft session and its target session (``SessionOpen.prefix_scope``, the same on
every rank) in its tenant's scope, salted by the request's ``cache_salt``
(:func:`specdec.engine.prefix_cache.prefix_scope`), so a session only starts from prefixes its own
tenant's sessions left and no tenant can time whether another recently sent a prompt prefix;
"shared" leaves the tenant out (only the salt separates). The start-up calibration's session has
the unsalted shared scope.

A model whose forward is not shape-invariant (float32) is served without prefix caching: one
warning line says so (a warning: Ray's worker processes drop info lines); start-up does not
fail, since the default asks for it on every model.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def serve_prefix_cache(loaded: Any, entries: int, role: str, *, live: bool = True, quiet: bool = False):
    """Attach a prefix cache of ``entries`` closed sessions to ``loaded``'s model when it can have one.

    Args:
        loaded: a :class:`specdec.models.loaded.LoadedModel` (``invariant`` says whether its
            forward is shape-invariant).
        entries: ``AppConfig.prefix_cache_entries`` (0: off).
        role: the model's role in log lines ("target", "draft").
        live: see :class:`specdec.engine.prefix_cache.PrefixCache`.
        quiet: log nothing (the TP ranks other than 0: one line per replica).

    Returns:
        the :class:`specdec.engine.prefix_cache.PrefixCache`, or None (off, or a float32 forward).
    """
    from specdec.engine.prefix_cache import disable_prefix_cache, enable_prefix_cache

    if entries <= 0:
        disable_prefix_cache(loaded.model)
        return None
    if not getattr(loaded, "invariant", False):
        disable_prefix_cache(loaded.model)
        if not quiet:
            log.warning("prefix caching off for the %s: its %s forward is not shape-invariant (copied keys and "
                     "values could differ in the last bits from computed ones); set prefix_cache_entries: 0 to "
                     "silence this line", role, getattr(loaded, "weight_format", "float32"))
        return None
    store = enable_prefix_cache(loaded.model, entries, live=live)
    if not quiet:
        log.info("prefix caching on for the %s: %d closed sessions kept%s", role, entries,
                 "" if live else " (copies only from closed sessions)")
    return store


def prefix_stats(model: Any) -> dict:
    """``{"enabled", "entries", "held", "hits", "shared_positions"}`` of ``model``'s prefix cache
    (a torch module; all 0 and ``enabled`` False without one): closed sessions kept at most and
    now, sessions started from a shared prefix and the positions copied, since start-up."""
    from specdec.engine.prefix_cache import prefix_cache_of

    store = prefix_cache_of(model)
    if store is None:
        return {"enabled": False, "entries": 0, "held": 0, "hits": 0, "shared_positions": 0}
    return {"enabled": True, **store.stats()}
