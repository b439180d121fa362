"""Benchmarks, outside the library's import path (nothing in ``specdec`` or ``deployments``
imports them; the ``specdec bench`` command loads :mod:`benchmarks.inprocess` on demand).

- :mod:`~benchmarks.inprocess`: ``specdec bench``: target alone vs transformers' assisted
  generation and prompt lookup vs ours, in one process; its tables and plot in
  :mod:`~benchmarks.report`.
- :mod:`~benchmarks.adaptive_k`: ``python -m benchmarks.adaptive_k``: adaptive K against fixed
  K on a mixed two-tenant workload.
- :mod:`~benchmarks.serving`: ``python -m benchmarks.serving``: served (gRPC + Ray Serve)
  against the in-process engine, and concurrency scaling.
"""
