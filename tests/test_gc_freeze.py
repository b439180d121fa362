"""specdec.engine.gc_freeze: a serving process's start-up objects out of full collections."""

from __future__ import annotations

import gc


def test_freezing_the_start_up_objects_leaves_full_collections_only_what_came_after():
    """After the freeze every object alive is in the permanent generation (gc.get_freeze_count), out
    of the oldest generation a full collection walks; cyclic garbage made later is still collected,
    and reference counting still frees a frozen object when its last reference goes."""
    from specdec.engine.gc_freeze import freeze_startup_objects

    class Node:
        pass

    keep = [Node() for _ in range(50_000)]  # start-up state
    try:
        frozen = freeze_startup_objects()
        assert frozen == gc.get_freeze_count() >= 50_000
        ids = {id(o) for o in gc.get_objects(2)}  # what a full collection walks: none of them
        assert not any(id(n) in ids for n in keep)
        cycle = Node()
        cycle.me = cycle  # cyclic garbage made after the freeze
        del cycle
        assert gc.collect() >= 1  # still found and freed
        gc.unfreeze()
        ids = {id(o) for o in gc.get_objects(2)}
        assert all(id(n) in ids for n in keep)  # unfrozen: walked again
        import weakref

        gone = weakref.ref(keep[0])
        keep.clear()
        assert gone() is None  # freed by reference counting, frozen or not
    finally:
        gc.unfreeze()


def test_a_replica_built_outside_a_ray_actor_does_not_freeze():
    """deployments.config.freeze_startup_objects_in_actor: None in a test process (no Ray actor),
    which builds replicas in process many times."""
    from deployments.config import freeze_startup_objects_in_actor

    before = gc.get_freeze_count()
    assert freeze_startup_objects_in_actor() is None
    assert gc.get_freeze_count() == before


def test_a_ray_actor_freezes(monkeypatch):
    """Inside a Ray actor (``ray.is_initialized()`` and an actor id) the helper freezes and returns
    the count."""
    import ray

    from deployments.config import freeze_startup_objects_in_actor

    class Context:
        def get_actor_id(self):
            return "ab"

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    try:
        frozen = freeze_startup_objects_in_actor()
        assert frozen == gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
