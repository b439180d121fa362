"""What runs per speculation step: the decoding loop and everything it calls.

- :mod:`~specdec.engine.decoder`: the loop of one request (propose, verify, accept, stop).
- :mod:`~specdec.engine.engine`: the in-process engine (:class:`SpeculativeEngine`): target,
  proposers and loop in one process, no Ray.
- :mod:`~specdec.engine.sessions`: opens one request's proposer and target sessions, output
  assembler and loop; used by the in-process engine and by the serving layer's draft replica.
- :mod:`~specdec.engine.verifier`: greedy verification and modified rejection sampling; the
  target session.
- :mod:`~specdec.engine.proposers`: the draft model and prompt lookup (one interface).
- :mod:`~specdec.engine.sampling`: warping (temperature/top-k/top-p/min-p), greedy tie-break,
  sparse proposals, per-position seeds.
- :mod:`~specdec.engine.processors`: logit bias, repetition/presence/frequency penalties and
  min_tokens, applied to p and q at every position of a block against the prefix that ends there.
- :mod:`~specdec.engine.kv_cache`: a token sequence with its KV cache, cut back to the accepted
  prefix.
- :mod:`~specdec.engine.stopping`: incremental detokenization, stop conditions, safe streaming.
- :mod:`~specdec.engine.batch`: continuous batching: the step scheduler that drafts and verifies
  many generations' blocks in shared forwards.
- :mod:`~specdec.engine.draft_combiner`: batched drafting for a serving replica whose generations
  are stepped by separate threads.
- :mod:`~specdec.engine.fairness`: tenants' weighted fair shares of a batched forward.

What decides K per tenant is in :mod:`specdec.control`.
"""
