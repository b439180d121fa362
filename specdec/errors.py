"""Typed errors raised by the specdec core.

The core never imports gRPC; the serving layer maps each class to one gRPC status code in a
single table (``deployments/grpc_status.py``). Every error carries a message meant for the
client: it says what was wrong and, where it helps, what to do.
"""

from __future__ import annotations


class SpecDecError(Exception):
    """Base class of every error the core raises on purpose."""


class InvalidRequestError(SpecDecError, ValueError):
    """A request parameter is out of range or malformed (gRPC: INVALID_ARGUMENT)."""


class InvalidBlockError(InvalidRequestError):
    """A candidate block is malformed: ids out of range or a proposal distribution that is not one
    (gRPC: INVALID_ARGUMENT). Raised by :func:`specdec.engine.verifier.validate_block`."""


class PromptTooLongError(InvalidRequestError):
    """The prompt alone leaves no room for one generated token within the context limit.

    Attributes:
        prompt_tokens: length of the tokenized prompt, in tokens.
        limit: the context limit that applies, in tokens (positions).
    """

    def __init__(self, prompt_tokens: int, limit: int, what: str = "the model's context"):
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        super().__init__(
            f"prompt is {prompt_tokens} tokens but {what} holds {limit} positions; "
            f"at most {limit - 1} prompt tokens leave room for one generated token"
        )


class ContextLengthExceededError(InvalidRequestError):
    """The prompt fits, but the prompt plus the ``max_tokens`` the caller set exceed the context
    limit (OpenAI's and vLLM's 400 ``context_length_exceeded``; gRPC: INVALID_ARGUMENT).

    Only an explicit ``max_tokens`` is refused: a request that leaves it out generates up to the
    context (or its default), as OpenAI's API does. The message is OpenAI's, with the numbers.

    Attributes:
        prompt_tokens: length of the tokenized prompt, in tokens.
        max_tokens: the ``max_tokens`` the caller asked for.
        limit: the context limit that applies, in tokens (positions).
    """

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, prompt_name: str = "prompt"):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {prompt_name}, {max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_name} or completion."
        )


class ModelLoadError(SpecDecError):
    """A model could not be found, assembled, verified (sha256) or loaded."""


class ModelCompatibilityError(SpecDecError):
    """The draft and target cannot be paired: tokenizer, vocabulary or special ids differ.

    Raised at start-up, before anything is served. The message names both models and the
    first differing token or id.
    """


class ModelNotReadyError(SpecDecError):
    """A model or replica is not loaded yet, or is shutting down (gRPC: UNAVAILABLE)."""


class ModelNotFoundError(SpecDecError):
    """The request names a model this server does not serve (gRPC: NOT_FOUND, HTTP: 404)."""


class AuthenticationError(SpecDecError):
    """No API key, or an unknown one (gRPC: UNAUTHENTICATED)."""


class PermissionDeniedError(SpecDecError):
    """The caller is authenticated but asks for something it may not read (gRPC: PERMISSION_DENIED)."""


class ResourceExhaustedError(SpecDecError):
    """A tenant limit is exceeded (gRPC: RESOURCE_EXHAUSTED).

    Attributes:
        limit: the name of the limit that fired (e.g. ``"tokens_per_minute"``).
        retry_after_s: seconds after which the same request may succeed, or None if it never will.
    """

    def __init__(self, message: str, limit: str, retry_after_s: float | None = None):
        self.limit = limit
        self.retry_after_s = retry_after_s
        super().__init__(message)


class GenerationCancelledError(SpecDecError):
    """The generation was cancelled by its caller (gRPC: CANCELLED); its caches were freed."""


class DeadlineExceededError(SpecDecError):
    """The caller's deadline passed before the generation finished (gRPC: DEADLINE_EXCEEDED)."""
