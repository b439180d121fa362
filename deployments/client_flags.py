"""``specdec client``'s flags checked here before anything is sent, with errors that name the flag.

The server validates every request with the core's rules (:class:`specdec.request.GenerationRequest`)
and names a field as the wire spells it (``speculation.max_k``, ``sampling.top_p``), which a
command-line user never typed. The same rules run here on the flags' values first, so
``specdec client -k 99`` answers ``-k: Input should be less than or equal to 16`` without a
round trip, and a non-positive ``--timeout`` (which gRPC would only report as an expired
deadline) is refused as the usage error it is. What only the server knows (the tenant's limits,
the model's context and vocabulary) is still the server's to refuse.
"""

from __future__ import annotations

import math
import re

from pydantic import ValidationError

from specdec.request import GenerationRequest

#: Core request field paths -> the ``specdec client`` flag that sets them.
FLAG_OF_FIELD: dict[str, str] = {
    "prompt": "the prompt",
    "messages": "--message",
    "max_tokens": "--max-tokens",
    "min_tokens": "--min-tokens",
    "stop": "--stop",
    "logprobs": "--logprobs",
    "top_logprobs": "--top-logprobs",
    "sampling.temperature": "--temperature",
    "sampling.top_p": "--top-p",
    "sampling.top_k": "--top-k",
    "sampling.seed": "--seed",
    "sampling.min_p": "--min-p",
    "sampling.repetition_penalty": "--repetition-penalty",
    "sampling.presence_penalty": "--presence-penalty",
    "sampling.frequency_penalty": "--frequency-penalty",
    "sampling.logit_bias": "--logit-bias",
    "speculation.proposer": "--proposer",
    "speculation.k": "-k",
    "speculation.draft_min_confidence": "--draft-min-confidence",
}
#: Field names as the core's cross-field messages write them ("min_tokens (9) must be <= max_tokens (8)",
#: "top_logprobs needs logprobs", "stop strings must not be empty"), longest first so
#: ``top_logprobs`` is not read as ``logprobs``.
_BARE_FIELD = re.compile(r"\b(top_logprobs|min_tokens|max_tokens|logprobs|stop)\b")
#: A rule of a nested object that names its field first: "logit_bias: the bias of token 5 must be ...".
_LEADING_FIELD = re.compile(r"([a-z_]+): (.*)", re.S)


def flag_of(loc: tuple) -> str:
    """The flag for a pydantic error location: the longest field path it starts with
    (``("sampling", "logit_bias", 7, "[key]")`` -> ``--logit-bias``); the dotted path itself
    where no flag sets it."""
    parts = [str(p) for p in loc]
    for n in range(len(parts), 0, -1):
        flag = FLAG_OF_FIELD.get(".".join(parts[:n]))
        if flag is not None:
            return flag
    return ".".join(parts)


def request_data(kwargs: dict, prompt: str | None, messages: list[dict] | None) -> dict:
    """The core request (plain data) that :func:`deployments.client.build_request` would send for
    these keyword arguments (:func:`deployments.cli.request_kwargs`); unset values are left out,
    as on the wire."""
    sampling = {key: kwargs[key] for key in ("temperature", "top_k", "min_p", "presence_penalty",
                                             "frequency_penalty", "logit_bias")}
    for key in ("top_p", "seed", "repetition_penalty"):
        if kwargs[key] is not None:
            sampling[key] = kwargs[key]
    speculation = {"proposer": kwargs["proposer"], "k": kwargs["k"],
                   "draft_min_confidence": kwargs["draft_min_confidence"]}
    data = {"max_tokens": kwargs["max_tokens"], "stop": list(kwargs["stop"]), "logprobs": kwargs["logprobs"],
            "top_logprobs": kwargs["top_logprobs"], "min_tokens": kwargs["min_tokens"], "sampling": sampling,
            "speculation": {k: v for k, v in speculation.items() if v is not None}}
    if messages is not None:
        data["messages"] = messages
    else:
        data["prompt"] = prompt
    return data


def flag_problem(kwargs: dict, prompt: str | None, messages: list[dict] | None,
                 timeout: float | None) -> str | None:
    """What is wrong with ``specdec client``'s flags, naming each flag, or None.

    Args:
        kwargs: :func:`deployments.cli.request_kwargs` of the parsed flags.
        prompt, messages: the request's input (one of them set).
        timeout: ``--timeout`` in seconds, or None.

    Returns:
        ``"-k: Input should be less than or equal to 16"``, ``"--timeout must be a positive number
        of seconds, got -1"``, ``"--top-logprobs needs --logprobs"``, ... (several problems joined
        by ``"; "``), or None when the server would accept what these flags set.
    """
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        return f"--timeout must be a positive number of seconds, got {timeout:g}"
    try:
        GenerationRequest.model_validate(request_data(kwargs, prompt, messages))
    except ValidationError as e:
        parts = []
        for err in e.errors():
            msg, loc = err["msg"].removeprefix("Value error, "), tuple(err["loc"])
            lead = _LEADING_FIELD.fullmatch(msg)
            if loc and lead and ".".join(map(str, (*loc, lead.group(1)))) in FLAG_OF_FIELD:
                loc, msg = (*loc, lead.group(1)), lead.group(2)  # ("sampling",) "logit_bias: ..." -> --logit-bias
            if loc:
                parts.append(f"{flag_of(loc)}: {msg}")
            else:  # a rule over several fields, written with the core's field names
                parts.append(_BARE_FIELD.sub(lambda m: FLAG_OF_FIELD[m.group(1)], msg))
        return "; ".join(parts)
    return None
