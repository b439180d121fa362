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

from specdec.cli import FLAG_OF_FIELD, request_from_flags
from specdec.request import GenerationRequest

#: Field names as the core's cross-field messages write them ("min_tokens (9) must be <= max_tokens (8)",
#: "top_logprobs needs logprobs", "stop strings must not be empty"), longest first so
#: ``top_logprobs`` is not read as ``logprobs``.
_BARE_FIELD = re.compile(r"\b(top_logprobs|min_tokens|max_tokens|logprobs|stop)\b")
#: A rule of a nested object that names its field first: "logit_bias: the bias of token 5 must be ...".
_LEADING_FIELD = re.compile(r"([a-z_]+): (.*)", re.S)


def flag_of(loc: tuple) -> str:
    """The flag for a pydantic error location: the longest field path it starts with
    (``("sampling", "logit_bias", 7, "[key]")`` -> ``--logit-bias``, ``("messages", 0, "role")``
    -> ``--message``; :data:`specdec.cli.FLAG_OF_FIELD`); the dotted path itself where no flag
    sets it (``prompt``)."""
    parts = [str(p) for p in loc]
    for n in range(len(parts), 0, -1):
        flag = FLAG_OF_FIELD.get(".".join(parts[:n]))
        if flag is not None:
            return flag
    return ".".join(parts)


def timeout_problem(timeout: float | None) -> str | None:
    """Why ``--timeout`` is not a deadline (zero, negative, nan or infinite seconds), or None."""
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        return f"--timeout must be a positive number of seconds, got {timeout:g}"
    return None


def flag_problem(args) -> str | None:
    """What is wrong with ``specdec client``'s flags, naming each flag, or None.

    Args:
        args: the parsed flags, with a prompt or well-formed ``--message`` and ``--logit-bias``
            values (:func:`deployments.cli.run_client` checks those first).

    Returns:
        ``"-k: Input should be less than or equal to 16"``, ``"--timeout must be a positive number
        of seconds, got -1"``, ``"--top-logprobs needs --logprobs"``, ... (several problems joined
        by ``"; "``), or None when the server would accept what these flags set.
    """
    if timeout_problem(args.timeout):
        return timeout_problem(args.timeout)
    try:
        GenerationRequest.model_validate(request_from_flags(args))
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
