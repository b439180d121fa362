"""Tenant configuration (pydantic, from YAML), API-key authentication and per-request policy.

Configuration file (the router loads it; on Kubernetes it comes from a Secret)::

    tenants:
      - id: acme
        api_key_hashes: ["<sha256 hex of the key>"]   # never the key itself
        limits: {max_concurrent_requests: 8, tokens_per_minute: 60000,
                 max_tokens: 1024, max_prompt_tokens: 4096}
        speculation: {allowed_proposers: [draft, ngram], k_min: 0, k_max: 8,
                      adaptive: true, fixed_k: null}

Make a key and its hash with ``python -m specdec.control.tenants new-key``, or hash an existing key read
from stdin with ``python -m specdec.control.tenants hash-key``.

What :meth:`TenantRegistry.check_request` does with a request beyond the tenant's policy:

=====================================  ====================================================
request                                outcome
=====================================  ====================================================
prompt longer than max_prompt_tokens   InvalidRequestError (INVALID_ARGUMENT): retrying the
                                       same request can never succeed
max_tokens above limits.max_tokens     InvalidRequestError (INVALID_ARGUMENT): silently
                                       shortening an answer would surprise the caller
proposer not in allowed_proposers      InvalidRequestError (INVALID_ARGUMENT); ``"none"``
                                       (plain decoding) is always allowed
k above speculation.k_max              clipped to k_max (K never changes the output, only
                                       speed); reported in ``CheckedRequest.clipped``
k below speculation.k_min              honoured: the caller's k is a ceiling, and a smaller
                                       K only makes the request cheaper for the server
=====================================  ====================================================

Going over a *rate* (tokens per minute, concurrent requests) is RESOURCE_EXHAUSTED, raised by
:mod:`specdec.control.limits`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import sys
from dataclasses import dataclass
from typing import Sequence, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec.errors import AuthenticationError, InvalidRequestError, SpecDecError
from specdec.request import MAX_SPECULATION_LENGTH, Proposer

#: Longest API key accepted in the authorization metadata, in characters.
MAX_API_KEY_CHARS = 512

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class TenantConfigError(SpecDecError, ValueError):
    """The tenant configuration file is missing, not YAML, or invalid (names the field)."""


def hash_api_key(key: str) -> str:
    """The stored form of an API key: sha256 of its UTF-8 bytes, lowercase hex (64 chars)."""
    if not isinstance(key, str) or not key:
        raise ValueError("API key must be a non-empty string")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_api_key() -> str:
    """A new random API key (``sk-`` + 43 URL-safe characters, 256 bits)."""
    return "sk-" + secrets.token_urlsafe(32)


class TenantLimits(BaseModel):
    """Per-tenant limits. Token counts are model tokens.

    Attributes:
        max_concurrent_requests: requests in flight (queued or running) at once.
        tokens_per_minute: prompt + max_tokens reserved per minute (token bucket, burst one
            minute's worth); None = unlimited.
        max_tokens: largest ``max_tokens`` a request may ask for.
        max_prompt_tokens: longest prompt, in tokens.
    """

    model_config = ConfigDict(extra="forbid")
    max_concurrent_requests: int = Field(4, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_tokens: int = Field(1024, ge=1)
    max_prompt_tokens: int = Field(4096, ge=1)


class SpeculationPolicy(BaseModel):
    """How the controller may choose K for a tenant.

    Attributes:
        allowed_proposers: proposers the tenant may ask for (``"none"`` is always allowed).
        k_min, k_max: the K range the controller chooses in (K = 0 needs k_min = 0).
        adaptive: let the controller choose K; otherwise K = fixed_k (or k_max if unset).
        fixed_k: the K used when not adaptive; must lie in [k_min, k_max].
        batch_weight: the tenant's weight in the fair order of a batched target forward (its
            share of the positions budget relative to the other tenants with rows waiting).
    """

    model_config = ConfigDict(extra="forbid")
    allowed_proposers: list[Proposer] = Field(default_factory=lambda: ["draft", "ngram", "none"], min_length=1)
    k_min: int = Field(0, ge=0, le=MAX_SPECULATION_LENGTH)
    k_max: int = Field(8, ge=0, le=MAX_SPECULATION_LENGTH)
    adaptive: bool = True
    fixed_k: int | None = Field(None, ge=0, le=MAX_SPECULATION_LENGTH)
    batch_weight: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ranges(self) -> "SpeculationPolicy":
        if self.k_min > self.k_max:
            raise ValueError(f"k_min ({self.k_min}) must be <= k_max ({self.k_max})")
        if self.fixed_k is not None and not self.k_min <= self.fixed_k <= self.k_max:
            raise ValueError(f"fixed_k ({self.fixed_k}) must lie in [k_min={self.k_min}, k_max={self.k_max}]")
        if len(set(self.allowed_proposers)) != len(self.allowed_proposers):
            raise ValueError(f"allowed_proposers has duplicates: {self.allowed_proposers}")
        return self


class Tenant(BaseModel):
    """One tenant: id, hashed API keys, limits and speculation policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    api_key_hashes: list[str] = Field(min_length=1)
    limits: TenantLimits = Field(default_factory=TenantLimits)
    speculation: SpeculationPolicy = Field(default_factory=SpeculationPolicy)

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        out = []
        for i, h in enumerate(v):
            h2 = h.strip().lower()
            if not _HEX64.match(h2):
                raise ValueError(
                    f"entry {i} is not a sha256 hex digest (64 hex characters); store "
                    f"hash_api_key(key), never the key (python -m specdec.control.tenants hash-key)"
                )
            out.append(h2)
        if len(set(out)) != len(out):
            raise ValueError("duplicate key hash")
        return out


class TenantsConfig(BaseModel):
    """The whole tenant file: ids unique, each key hash belongs to one tenant."""

    model_config = ConfigDict(extra="forbid")
    tenants: list[Tenant] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "TenantsConfig":
        seen: dict[str, str] = {}
        ids: set[str] = set()
        for t in self.tenants:
            if t.id in ids:
                raise ValueError(f"duplicate tenant id {t.id!r}")
            ids.add(t.id)
            for h in t.api_key_hashes:
                if h in seen:
                    raise ValueError(f"key hash {h[:12]}… is listed for both {seen[h]!r} and {t.id!r}")
                seen[h] = t.id
        return self


def _format_validation_error(e: ValidationError, source: str) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        parts.append(f"{loc}: {msg}")
    return f"invalid tenant configuration {source}: " + "; ".join(parts)


def parse_tenants_config(data: dict | str, source: str = "<string>") -> TenantsConfig:
    """Validate a dict, or YAML text, into a :class:`TenantsConfig`.

    Raises:
        TenantConfigError: with the YAML error or pydantic's field-by-field message.
    """
    if isinstance(data, str):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as e:
            raise TenantConfigError(f"tenant configuration {source} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise TenantConfigError(
            f"tenant configuration {source} must be a mapping with a 'tenants' list, got {type(data).__name__}"
        )
    try:
        return TenantsConfig.model_validate(data)
    except ValidationError as e:
        raise TenantConfigError(_format_validation_error(e, source)) from None


def load_tenants_config(path: str | os.PathLike) -> TenantsConfig:
    """Read and validate the tenant YAML file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TenantConfigError(f"cannot read tenant configuration {path}: {e.strerror}") from None
    return parse_tenants_config(text, source=str(path))


@dataclass(frozen=True)
class CheckedRequest:
    """A request's parameters after the tenant's policy was applied.

    Attributes:
        max_tokens: unchanged (over the limit is an error, never clipped).
        proposer: unchanged.
        k_max: the largest K the controller may use: min(request k, policy k_max); 0 for
            proposer ``"none"``.
        k_min: the smallest K the controller may use: min(policy k_min, k_max).
        clipped: human-readable notes on what was clipped (empty if nothing).
    """

    max_tokens: int
    proposer: str
    k_max: int
    k_min: int
    clipped: tuple[str, ...] = ()


class TenantRegistry:
    """Tenants by id and by key hash; authentication and request policy."""

    def __init__(self, config: TenantsConfig):
        self.config = config
        self._by_id = {t.id: t for t in config.tenants}
        self._hashes: list[tuple[bytes, Tenant]] = [
            (bytes.fromhex(h), t) for t in config.tenants for h in t.api_key_hashes
        ]

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "TenantRegistry":
        return cls(load_tenants_config(path))

    @property
    def tenants(self) -> list[Tenant]:
        return list(self.config.tenants)

    def get(self, tenant_id: str) -> Tenant:
        """The tenant with ``tenant_id``; KeyError if there is none."""
        return self._by_id[tenant_id]

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant owning the key in an ``authorization`` metadata value ``"Bearer <key>"``.

        The scheme is case-insensitive; surrounding whitespace is ignored. The presented key
        is hashed and compared with *every* stored hash with :func:`hmac.compare_digest`
        (no early exit), so timing reveals neither which hash nor how much of it matched.

        Raises:
            AuthenticationError: missing value ("missing API key …"), not ``Bearer <key>``
                ("malformed authorization …"), or a key no tenant has ("unknown API key").
        """
        if authorization is None or not authorization.strip():
            raise AuthenticationError(
                "missing API key: send 'authorization: Bearer <key>' (gRPC metadata or HTTP header)"
            )
        parts = authorization.strip().split(None, 1)
        if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1].strip():
            raise AuthenticationError(
                "malformed authorization: expected 'Bearer <key>'"
            )
        key = parts[1].strip()
        if len(key) > MAX_API_KEY_CHARS or any(ch.isspace() for ch in key):
            raise AuthenticationError(
                "malformed authorization: expected 'Bearer <key>'"
            )
        digest = hashlib.sha256(key.encode("utf-8")).digest()
        found: Tenant | None = None
        for stored, tenant in self._hashes:
            if hmac.compare_digest(stored, digest):
                found = tenant
        if found is None:
            raise AuthenticationError("unknown API key")
        return found

    @staticmethod
    def check_proposer(tenant: Tenant, proposer: str) -> None:
        """Refuse a proposer ``tenant`` may not use (``"none"``, plain decoding, is always allowed):
        what :meth:`check_request` says of a request naming it, and ``GetTenantStats`` of a query.

        Raises:
            InvalidRequestError: ``speculation.proposer: 'draft' is not allowed for tenant ...``.
        """
        pol = tenant.speculation
        if proposer != "none" and proposer not in pol.allowed_proposers:
            allowed = sorted(set(pol.allowed_proposers) | {"none"})
            raise InvalidRequestError(
                f"speculation.proposer: {proposer!r} is not allowed for tenant {tenant.id!r}; allowed: {allowed}"
            )

    def check_request(
        self, tenant: Tenant, prompt_tokens: int, max_tokens: int, k: int, proposer: str,
        default_proposers: Sequence[str] | None = None,
    ) -> CheckedRequest:
        """Apply ``tenant``'s limits and speculation policy to one request (see module table).

        Args:
            default_proposers: when the request named no proposer (``proposer`` is the server's
                default), the proposers the server can run, in order of preference: the first one
                the tenant allows replaces a default it does not allow (``"none"`` if none is
                allowed). None: the request named ``proposer`` itself, which must be allowed.

        Raises:
            InvalidRequestError: prompt too long, max_tokens over the limit, or a proposer the
                tenant may not use. The message names the limit and its value.
        """
        lim = tenant.limits
        pol = tenant.speculation
        if prompt_tokens > lim.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompt is {prompt_tokens} tokens but tenant {tenant.id!r} allows at most "
                f"{lim.max_prompt_tokens} (limits.max_prompt_tokens)"
            )
        if max_tokens > lim.max_tokens:
            raise InvalidRequestError(
                f"max_tokens={max_tokens} exceeds the limit of tenant {tenant.id!r}, {lim.max_tokens} "
                f"(limits.max_tokens)"
            )
        if proposer not in get_args(Proposer):
            raise InvalidRequestError(f"unknown proposer {proposer!r}; known: {list(get_args(Proposer))}")
        if default_proposers is not None and proposer != "none" and proposer not in pol.allowed_proposers:
            proposer = next((p for p in default_proposers if p in pol.allowed_proposers), "none")
        self.check_proposer(tenant, proposer)
        if k < 0:
            raise InvalidRequestError(f"k must be >= 0, got {k}")
        clipped: list[str] = []
        if proposer == "none":
            k_max = 0
        else:
            k_max = k
            if k > pol.k_max:
                k_max = pol.k_max
                clipped.append(f"k={k} clipped to the tenant's k_max={pol.k_max}")
        return CheckedRequest(
            max_tokens=max_tokens,
            proposer=proposer,
            k_max=k_max,
            k_min=min(pol.k_min, k_max),
            clipped=tuple(clipped),
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.control.tenants new-key | hash-key``.

    ``new-key`` prints a fresh key and its hash (give the key to the tenant, put the hash in
    the configuration). ``hash-key`` reads one key from stdin (not argv, so it stays out of
    shell history and process listings) and prints its hash.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["new-key"]:
        key = generate_api_key()
        print(f"api_key: {key}")
        print(f"api_key_hash: {hash_api_key(key)}")
        return 0
    if argv == ["hash-key"]:
        key = sys.stdin.readline().strip()
        if not key:
            print("hash-key: no key on stdin", file=sys.stderr)
            return 2
        print(hash_api_key(key))
        return 0
    print("usage: python -m specdec.control.tenants new-key | hash-key  (hash-key reads the key from stdin)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
