"""Opening one generation: its target session, proposer session, output assembler and loop.

The one place that builds them, used by the in-process engine
(:meth:`specdec.engine.engine.SpeculativeEngine.start`) and by the serving layer's draft replica
(``deployments.draft.Draft``). The two differ only in where the target session lives, so the
caller passes ``open_target``: the in-process verifier's ``open_session``, or a constructor of a
stand-in that sends each block to a remote target replica.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from specdec.engine.decoder import Generation, TargetLike
from specdec.engine.prefix_cache import prefix_scope
from specdec.engine.processors import LogitProcessing
from specdec.engine.proposers.draft_model import DraftModelProposer, draft_options
from specdec.engine.proposers.prompt_lookup import PromptLookupProposer
from specdec.engine.sampling import derive_seeds
from specdec.engine.stopping import OutputAssembler
from specdec.errors import InvalidRequestError, PromptTooLongError
from specdec.request import GenerationRequest
from specdec.types import Checkpoint


class TargetFacts(Protocol):
    """What building a generation needs to know of the target (a :class:`LoadedModel`, or the
    serving layer's ``TargetInfo`` read without the weights)."""

    name: str
    tokenizer: object
    max_positions: int

    @property
    def eos_token_ids(self) -> Sequence[int]: ...


#: ``open_target(history, sampling, seed, logprobs=, processing=, top_logprobs=, prefix_scope=) -> TargetLike``:
#: the target session, already holding ``history`` (token ids), seeded with the target side's
#: seed, applying the request's :class:`~specdec.engine.processors.LogitProcessing`, sharing
#: cached prefixes only within ``prefix_scope`` (:func:`specdec.engine.prefix_cache.prefix_scope`).
OpenTarget = Callable[..., TargetLike]


def open_generation(
    request: GenerationRequest,
    target: TargetFacts,
    prompt: Sequence[int],
    *,
    seed: int,
    draft_proposer: DraftModelProposer | None,
    open_target: OpenTarget,
    k,
    resume: Checkpoint | None = None,
    prefix_tenant: str = "",
) -> Generation:
    """Open the sessions of one request and return its (not yet run) :class:`Generation`.

    Proposer: ``draft`` (``draft_proposer``) or ``ngram`` (prompt lookup) when
    ``request.speculation.k > 0``, else none (plain decoding). The request's logit processing
    (penalties, logit bias, min-p, min_tokens) is applied identically by the draft and the target
    side. Both sessions start from the
    prompt followed by the checkpoint's tokens (``resume``), and get the draft and target seeds
    :func:`specdec.engine.sampling.derive_seeds` gives for ``seed``, so a generation resumed from
    a :class:`~specdec.types.Checkpoint` (the end of a step) continues exactly as it would have.

    Args:
        request: the validated request.
        target: the target's name, tokenizer, context limit (tokens) and EOS ids.
        prompt: the prompt's token ids.
        seed: the request's seed (the caller picks one when the request has none).
        draft_proposer: the draft model's proposer, or None when no draft is loaded.
        open_target: opens the target session (see :data:`OpenTarget`).
        k: the loop's largest K per step: an int or a callable asked before each step (for a
            resumed generation, one that continues from ``resume.steps`` steps).
        resume: where an earlier run of this request stopped (:meth:`Generation.checkpoint`,
            or one the serving layer rebuilt from what it streamed): its tokens extend both
            sessions' history and are re-fed to the output assembler (their logprobs too), and
            the first ``resume.sent_ids`` ids and ``resume.sent_text_chars`` characters count as
            streamed, so the first chunk continues after them. Its ``seed`` is not used:
            ``seed`` is (the caller checks they agree).
        prefix_tenant: the tenant whose sessions this request's draft and target sessions may
            share cached prefixes with (``""``: no tenant boundary); with the request's
            ``cache_salt`` it makes their prefix cache scope
            (:func:`specdec.engine.prefix_cache.prefix_scope`).

    Raises:
        PromptTooLongError: the prompt leaves no room for one token in the target's context.
        InvalidRequestError: the proposer is ``draft`` but no draft model is loaded.
    """
    limit = target.max_positions
    if len(prompt) >= limit:
        raise PromptTooLongError(len(prompt), limit, f"the target '{target.name}'")
    resumed = [int(t) for t in resume.token_ids] if resume is not None else []
    history = [int(t) for t in prompt] + resumed
    draft_seed, target_seed = derive_seeds(seed)
    spec = request.speculation
    processing = LogitProcessing.for_request(request, len(prompt), target.eos_token_ids)
    scope = prefix_scope(prefix_tenant, request.cache_salt)
    proposer = None
    if spec.proposer == "draft" and spec.k > 0:
        if draft_proposer is None:
            raise InvalidRequestError("proposer 'draft' needs a draft model; none is loaded")
        proposer = draft_proposer.open_session(history, request.sampling, draft_seed, **processing.options(),
                                               **draft_options(spec), prefix_scope=scope)
    elif spec.proposer == "ngram" and spec.k > 0:
        ngram = PromptLookupProposer(spec.ngram_min, spec.ngram_max, eos_ids=target.eos_token_ids)
        proposer = ngram.open_session(history, request.sampling, draft_seed)
    target_session = open_target(history, request.sampling, target_seed, logprobs=request.logprobs,
                                 processing=processing, top_logprobs=request.top_logprobs, prefix_scope=scope)
    assembler = OutputAssembler(
        target.tokenizer,
        max_tokens=request.max_tokens,
        eos_ids=() if request.ignore_eos else target.eos_token_ids,
        stop_token_ids=request.stop_token_ids,
        stop=request.stop,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
    )
    if resumed:
        logprobs = top = None
        if request.logprobs:  # placeholders where the checkpoint has none (already streamed, never resent)
            logprobs = list(resume.logprobs) if resume.logprobs is not None else [0.0] * len(resumed)
            if request.top_logprobs:
                top = [list(t) for t in resume.top_logprobs] if resume.top_logprobs is not None else [[]] * len(resumed)
        assembler.add(resumed, logprobs, top)
        assembler.mark_sent(min(resume.sent_ids, len(assembler.token_ids)), resume.sent_text_chars)
    return Generation(
        target=target_session,
        proposer=proposer,
        assembler=assembler,
        prompt_len=len(prompt),
        max_total_len=limit,
        k=k,
        seed=seed,
        steps_done=resume.steps if resume is not None else 0,
    )

