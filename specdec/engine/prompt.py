"""A request's prompt as token ids: text, chat messages (the target's chat template) or ids, and
whether it fits the target's context with the ``max_tokens`` the caller asked for.

Without torch: the serving layer's router tokenizes every request and holds no model
(``tests/deployments/test_lean_imports.py``); the in-process engine uses the same function.
"""

from __future__ import annotations

from specdec.errors import ContextLengthExceededError, InvalidRequestError, PromptTooLongError
from specdec.request import GenerationRequest


def encode_prompt(tokenizer, request: GenerationRequest, emittable: int) -> list[int]:
    """Tokenize the request's prompt: text, chat messages (target's chat template) or ids.

    Raises:
        InvalidRequestError: prompt or stop token ids outside the vocabulary, a tokenizer without
            a chat template, messages the chat template refuses (its ``raise_exception``: e.g.
            roles that do not alternate, a system message it has no place for; was an internal
            error, HTTP 500), or a prompt that tokenizes to nothing.
    """
    bad_stop = [t for t in request.stop_token_ids if not 0 <= t < emittable]
    if bad_stop:  # could never fire: a silent no-op is a wrong answer
        raise InvalidRequestError(f"stop_token_ids: id {bad_stop[0]} is outside the vocabulary 0..{emittable - 1}")
    bad_bias = [t for t in request.sampling.logit_bias if not 0 <= t < emittable]
    if bad_bias:
        raise InvalidRequestError(f"logit_bias: id {bad_bias[0]} is outside the vocabulary 0..{emittable - 1}")
    if request.prompt_token_ids is not None:
        ids = [int(t) for t in request.prompt_token_ids]
        bad = [t for t in ids if not 0 <= t < emittable]
        if bad:
            raise InvalidRequestError(f"prompt_token_ids: id {bad[0]} is outside the vocabulary 0..{emittable - 1}")
        return ids
    if request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this target has no chat template; send a prompt instead of messages")
        from jinja2.exceptions import TemplateError

        try:
            text = tokenizer.apply_chat_template(
                [m.model_dump() for m in request.messages], add_generation_prompt=True, tokenize=False
            )
        except TemplateError as e:
            # only the template's raise_exception (transformers raises exactly TemplateError: "roles
            # must alternate", ...) is the caller's; its subclasses (a syntax error, an undefined
            # variable, the sandbox's SecurityError, a missing include) are the template's bugs: the
            # server's fault
            if type(e) is not TemplateError:
                raise
            raise InvalidRequestError(f"messages: the target's chat template refuses them: {e}") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(request.prompt)
    if not ids:
        raise InvalidRequestError("the prompt tokenizes to no tokens")
    return list(ids)


def requested_max_tokens(request: GenerationRequest) -> int | None:
    """The ``max_tokens`` the caller set on ``request``, or None when it left it out (the default,
    :class:`GenerationRequest`'s 128, then applies, cut short by the context if need be)."""
    return request.max_tokens if "max_tokens" in request.model_fields_set else None


def check_context_length(prompt_tokens: int, max_tokens: int | None, limit: int, what: str,
                         prompt_name: str = "prompt") -> None:
    """Refuse a request that cannot be answered in full within the context limit.

    A prompt of ``limit`` tokens or more leaves no room for one token. A prompt that fits, with
    a ``max_tokens`` the caller set (not None) that does not fit beside it, is refused as OpenAI
    and vLLM refuse it (400 ``context_length_exceeded``), never generated and silently cut at the
    context. A request at the limit (``prompt_tokens + max_tokens == limit``) is accepted; one
    without ``max_tokens`` (None) is too: it generates up to the context.

    Args:
        prompt_tokens: length of the tokenized prompt.
        max_tokens: the ``max_tokens`` the caller set (:func:`requested_max_tokens`), or None.
        limit: the target's context, in positions.
        what: the context's owner for :class:`PromptTooLongError`'s message ("the target 'x'").
        prompt_name: ``"messages"`` for a chat request, else ``"prompt"`` (the message names it).

    Raises:
        PromptTooLongError: the prompt alone fills the context.
        ContextLengthExceededError: ``prompt_tokens + max_tokens > limit``.
    """
    if prompt_tokens >= limit:
        raise PromptTooLongError(prompt_tokens, limit, what)
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
        raise ContextLengthExceededError(prompt_tokens, max_tokens, limit, prompt_name)


def prompt_name(request: GenerationRequest) -> str:
    """How OpenAI's message names the request's prompt: ``messages`` (chat) or ``prompt``."""
    return "messages" if request.messages is not None else "prompt"
