"""The in-process engine: a target, an optional draft, prompt lookup, and the loop.

``SpeculativeEngine`` is what the CLI, the benchmark and tests use directly; the serving layer
uses the same pieces split across replicas.
"""

from __future__ import annotations

import secrets
from typing import Callable, Iterator

from specdec.engine.decoder import Generation
from specdec.engine.prompt import (  # noqa: F401 (encode_prompt: re-exported)
    check_context_length,
    encode_prompt,
    prompt_name,
    requested_max_tokens,
)
from specdec.engine.proposers.draft_model import DEFAULT_TOP_M, DraftModelProposer
from specdec.engine.sessions import open_generation
from specdec.engine.verifier import TargetVerifier
from specdec.errors import InvalidRequestError
from specdec.models.loaded import LoadedModel
from specdec.request import GenerationRequest
from specdec.types import Checkpoint, GenerationChunk, GenerationResult


class SpeculativeEngine:
    """Exact speculative decoding in one process.

    Args:
        target: the target model.
        draft: the draft model, or None (then only ``ngram`` and ``none`` proposers exist).
            Check the pair with :func:`specdec.models.vocab.check_pair_compatible` first
            (:func:`specdec.models.loader.load_pair` does).
        top_m: support size M of the draft's proposal distribution under sampling.
        lean_target: run the target's forwards (decode steps, verify blocks, prefill chunks, packed
            batches) through the lean forward (:class:`specdec.engine.verifier.TargetVerifier`'s ``lean``; bitwise the same
            logits, fewer Python calls per step); False: transformers' forward for every call.

    Raises:
        ValueError: the target was loaded with a vocabulary subset (only a draft may be).
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, *, top_m: int = DEFAULT_TOP_M,
                 lean_target: bool = True):
        if target.vocab_subset is not None:
            raise ValueError(f"target {target.name!r} was loaded with a vocabulary subset; the target must "
                             "score the full vocabulary (only a draft may score a subset)")
        self.target = target
        self.draft = draft
        self.verifier = TargetVerifier(target, lean=lean_target)
        eos = target.eos_token_ids
        self.draft_proposer = DraftModelProposer(draft, top_m=top_m, eos_ids=eos) if draft is not None else None

    def encode(self, request: GenerationRequest) -> list[int]:
        """Prompt token ids of ``request`` (see :func:`encode_prompt`)."""
        return encode_prompt(self.target.tokenizer, request, self.target.emittable_vocab)

    def start(self, request: GenerationRequest, k: int | Callable[[], int] | None = None,
              resume: Checkpoint | None = None, *, prefix_tenant: str = "") -> Generation:
        """Open the sessions of one request and return its (not yet run) :class:`Generation`.

        Args:
            request: the validated request.
            k: override of the largest K per step (an int or a callable asked before each step);
                defaults to ``request.speculation.k``.
            resume: continue an earlier run of the same request from its
                :meth:`Generation.checkpoint` (its seed too, also for a request without one): the
                output is token for token what that run would have produced, and the stream
                continues after what it had streamed.
            prefix_tenant: with prefix caching on (:mod:`specdec.engine.prefix_cache`), the tenant
                whose sequences this request's draft and target sequences may start from
                (``""``, the default: no tenant boundary, as :meth:`generate` and :meth:`stream`);
                the request's ``cache_salt`` narrows the scope further
                (:func:`specdec.engine.prefix_cache.prefix_scope`). A
                :class:`specdec.engine.batch.BatchScheduler` passes its requests' tenants.

        Raises:
            InvalidRequestError: the proposer is ``draft`` but no draft model is loaded; bad ids;
                a checkpoint whose seed differs from the request's.
            PromptTooLongError: the prompt leaves no room for one token in the target's context.
            ContextLengthExceededError: the request sets ``max_tokens`` and the prompt plus it
                exceed the target's context (left out, it generates up to the context).
        """
        prompt = self.encode(request)
        check_context_length(len(prompt), requested_max_tokens(request), self.target.max_positions,
                             f"the target '{self.target.name}'", prompt_name(request))
        seed = request.sampling.seed
        if resume is not None:
            if seed is not None and seed != resume.seed:
                raise InvalidRequestError(f"the checkpoint was taken with seed {resume.seed}, the request has {seed}")
            seed = resume.seed
        if seed is None:
            seed = secrets.randbits(63)
        return open_generation(
            request, self.target, prompt, seed=seed, draft_proposer=self.draft_proposer,
            open_target=self.verifier.open_session, k=request.speculation.k if k is None else k, resume=resume,
            prefix_tenant=prefix_tenant,
        )

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run ``request`` to the end."""
        return self.start(request).run()

    def stream(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Run ``request``, yielding chunks as they become safe to send."""
        yield from self.start(request)
