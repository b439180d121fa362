"""Telling Ray's wrapper exceptions apart: the original error, and "the replica died"."""

from __future__ import annotations


def unwrap(exc: BaseException) -> BaseException:
    """The original error behind Ray's wrappers (``RayTaskError`` chains), else ``exc``."""
    seen = 0
    while seen < 8:
        cause = getattr(exc, "cause", None)
        if cause is None or cause is exc or not isinstance(cause, BaseException):
            break
        exc, seen = cause, seen + 1
    return exc


def is_replica_death(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica running the call died (the call may be retried)."""
    try:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover
        return False
    kinds = (RayActorError, ActorDiedError, ActorUnavailableError)
    return isinstance(exc, kinds) or isinstance(unwrap(exc), kinds)
