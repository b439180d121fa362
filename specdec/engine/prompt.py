"""A request's prompt as token ids: text, chat messages (the target's chat template) or ids.

Without torch: the serving layer's router tokenizes every request and holds no model
(``tests/deployments/test_lean_imports.py``); the in-process engine uses the same function.
"""

from __future__ import annotations

from specdec.errors import InvalidRequestError
from specdec.request import GenerationRequest


def encode_prompt(tokenizer, request: GenerationRequest, emittable: int) -> list[int]:
    """Tokenize the request's prompt: text, chat messages (target's chat template) or ids.

    Raises:
        InvalidRequestError: prompt or stop token ids outside the vocabulary, a tokenizer without
            a chat template, or a prompt that tokenizes to nothing.
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
        text = tokenizer.apply_chat_template(
            [m.model_dump() for m in request.messages], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(request.prompt)
    if not ids:
        raise InvalidRequestError("the prompt tokenizes to no tokens")
    return list(ids)
