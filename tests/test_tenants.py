"""Tenant config, authentication, request policy, rate limits and fair admission."""

import asyncio
import hashlib

import pytest

from specdec.errors import AuthenticationError, InvalidRequestError, ResourceExhaustedError
from specdec.control.limits import FairAdmission, RateLimiter
from specdec.control.tenants import (
    TenantConfigError,
    TenantRegistry,
    generate_api_key,
    hash_api_key,
    main,
    parse_tenants_config,
)

KEY_A = "sk-alpha-0123456789"
KEY_B = "sk-bravo-9876543210"

YAML = f"""
tenants:
  - id: acme
    api_key_hashes: ["{hash_api_key(KEY_A)}"]
    limits: {{max_concurrent_requests: 2, tokens_per_minute: 600, max_tokens: 256, max_prompt_tokens: 1000}}
    speculation: {{allowed_proposers: [draft], k_min: 0, k_max: 6}}
  - id: globex
    api_key_hashes: ["{hash_api_key(KEY_B).upper()}"]
"""


@pytest.fixture
def reg():
    return TenantRegistry(parse_tenants_config(YAML))


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


# ---------------------------------------------------------------- config


def test_hash_api_key_is_sha256_hex():
    assert hash_api_key("abc") == hashlib.sha256(b"abc").hexdigest()
    assert len(hash_api_key(generate_api_key())) == 64
    with pytest.raises(ValueError):
        hash_api_key("")


def test_config_loads_with_defaults(reg):
    acme = reg.get("acme")
    assert acme.limits.tokens_per_minute == 600
    assert acme.speculation.allowed_proposers == ["draft"]
    globex = reg.get("globex")
    assert globex.api_key_hashes == [hash_api_key(KEY_B)]  # normalised to lowercase
    assert globex.limits.max_concurrent_requests == 4 and globex.limits.tokens_per_minute is None
    assert globex.speculation.k_max == 8 and globex.speculation.adaptive


@pytest.mark.parametrize(
    "text, needle",
    [
        ("tenants: [{id: a, api_key_hashes: [sk-plaintext]}]",
         "tenants.0.api_key_hashes: entry 0 is not a sha256 hex digest"),
        (f"tenants: [{{id: a, api_key_hashes: ['{'a' * 64}'], speculation: {{k_min: 5, k_max: 2}}}}]",
         "tenants.0.speculation: k_min (5) must be <= k_max (2)"),
        (f"tenants: [{{id: a, api_key_hashes: ['{'a' * 64}'], speculation: {{k_max: 4, fixed_k: 6}}}}]",
         "fixed_k (6) must lie in [k_min=0, k_max=4]"),
        (f"tenants: [{{id: a, api_key_hashes: ['{'a' * 64}']}}, {{id: a, api_key_hashes: ['{'b' * 64}']}}]",
         "duplicate tenant id 'a'"),
        (f"tenants: [{{id: a, api_key_hashes: ['{'a' * 64}']}}, {{id: b, api_key_hashes: ['{'a' * 64}']}}]",
         "is listed for both 'a' and 'b'"),
        (f"tenants: [{{id: a, api_key_hashes: ['{'a' * 64}'], limits: {{max_tokens: 0}}}}]",
         "tenants.0.limits.max_tokens: Input should be greater than or equal to 1"),
        (f"tenants: [{{id: a, api_key_hashes: ['{'a' * 64}'], limts: {{}}}}]", "tenants.0.limts: Extra inputs"),
        ("tenants: [", "is not valid YAML"),
        ("- just a list", "must be a mapping with a 'tenants' list"),
    ],
)
def test_config_errors_are_clear(text, needle):
    with pytest.raises(TenantConfigError) as ei:
        parse_tenants_config(text)
    assert needle in str(ei.value)


def test_cli_hash_key(monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("secret-key\n"))
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_api_key("secret-key")
    assert main(["new-key"]) == 0
    out = capsys.readouterr().out.split()
    assert out[0] == "api_key:" and out[3] == hash_api_key(out[1])
    assert main([]) == 2


# ---------------------------------------------------------------- auth


def test_authenticate_ok(reg):
    assert reg.authenticate(f"Bearer {KEY_A}").id == "acme"
    assert reg.authenticate(f"  bearer   {KEY_B} ").id == "globex"


@pytest.mark.parametrize(
    "header, message",
    [
        (None, "missing API key: send 'authorization: Bearer <key>' (gRPC metadata or HTTP header)"),
        ("", "missing API key: send 'authorization: Bearer <key>' (gRPC metadata or HTTP header)"),
        (KEY_A, "malformed authorization: expected 'Bearer <key>'"),
        ("Basic abc", "malformed authorization: expected 'Bearer <key>'"),
        ("Bearer ", "malformed authorization: expected 'Bearer <key>'"),
        ("Bearer a b", "malformed authorization: expected 'Bearer <key>'"),
        ("Bearer " + "x" * 600, "malformed authorization: expected 'Bearer <key>'"),
        ("Bearer sk-unknown", "unknown API key"),
        (f"Bearer {hash_api_key(KEY_A)}", "unknown API key"),  # the hash is not the key
    ],
)
def test_authenticate_errors(reg, header, message):
    with pytest.raises(AuthenticationError) as ei:
        reg.authenticate(header)
    assert str(ei.value) == message


# ---------------------------------------------------------------- request policy


def test_check_request_clips_k_and_rejects_the_rest(reg):
    acme = reg.get("acme")
    c = reg.check_request(acme, prompt_tokens=10, max_tokens=256, k=9, proposer="draft")
    assert (c.k_max, c.k_min, c.clipped) == (6, 0, ("k=9 clipped to the tenant's k_max=6",))
    c = reg.check_request(acme, 10, 100, 3, "draft")
    assert (c.k_max, c.clipped) == (3, ())
    assert reg.check_request(acme, 10, 100, 4, "none").k_max == 0  # plain decoding always allowed
    with pytest.raises(InvalidRequestError, match=r"max_tokens=257 exceeds the limit of tenant 'acme', 256"):
        reg.check_request(acme, 10, 257, 4, "draft")
    with pytest.raises(InvalidRequestError, match=r"prompt is 1001 tokens but tenant 'acme' allows at most 1000"):
        reg.check_request(acme, 1001, 10, 4, "draft")
    with pytest.raises(InvalidRequestError, match=r"speculation.proposer: 'ngram' is not allowed for tenant 'acme'; allowed: \['draft', 'none'\]"):
        reg.check_request(acme, 10, 10, 4, "ngram")


def test_unnamed_proposer_falls_back_to_one_the_tenant_allows(reg):
    acme = reg.get("acme")  # allows draft only
    servers = ["draft", "ngram"]
    assert reg.check_request(acme, 10, 10, 4, "ngram", default_proposers=servers).proposer == "draft"
    assert reg.check_request(acme, 10, 10, 4, "ngram", default_proposers=["ngram"]).proposer == "none"
    assert reg.check_request(acme, 10, 10, 4, "ngram", default_proposers=["ngram"]).k_max == 0
    assert reg.check_request(acme, 10, 10, 4, "draft", default_proposers=servers).proposer == "draft"
    globex = reg.get("globex")  # default policy: any proposer
    assert reg.check_request(globex, 10, 10, 4, "draft", default_proposers=servers).proposer == "draft"
    with pytest.raises(InvalidRequestError, match="speculation.proposer: 'ngram' is not allowed"):  # named: refused
        reg.check_request(acme, 10, 10, 4, "ngram")


# ---------------------------------------------------------------- rate limits


def test_token_bucket_retry_after_is_exact(reg):
    clock = FakeClock()
    rl = RateLimiter(clock=clock)
    acme = reg.get("acme")  # 600 tokens/minute = 10 tokens/s, burst 600
    rl.acquire(acme, 500).release(used_tokens=500)
    rl.acquire(acme, 100).release(used_tokens=100)
    with pytest.raises(ResourceExhaustedError) as ei:
        rl.acquire(acme, 100)
    assert ei.value.limit == "tokens_per_minute"
    assert ei.value.retry_after_s == pytest.approx(10.0)
    assert "limit of 600 tokens per minute" in str(ei.value)
    clock.t += 4.0
    with pytest.raises(ResourceExhaustedError) as ei:
        rl.acquire(acme, 100)
    assert ei.value.retry_after_s == pytest.approx(6.0)
    clock.t += 6.0
    rl.acquire(acme, 100).release(used_tokens=100)
    assert rl.available_tokens(acme) == pytest.approx(0.0)


def test_refund_unused_reservation_and_oversized_request(reg):
    clock = FakeClock()
    rl = RateLimiter(clock=clock)
    acme = reg.get("acme")
    lease = rl.acquire(acme, 400)
    assert rl.available_tokens(acme) == pytest.approx(200)
    lease.release(used_tokens=150)
    lease.release(used_tokens=0)  # idempotent
    assert rl.available_tokens(acme) == pytest.approx(450)
    with pytest.raises(ResourceExhaustedError) as ei:
        rl.acquire(acme, 601)
    assert ei.value.limit == "tokens_per_minute" and ei.value.retry_after_s is None


def test_concurrency_limit_and_other_tenants_unaffected(reg):
    rl = RateLimiter(clock=FakeClock())
    acme, globex = reg.get("acme"), reg.get("globex")
    l1, l2 = rl.acquire(acme, 10), rl.acquire(acme, 10)
    with pytest.raises(ResourceExhaustedError) as ei:
        rl.acquire(acme, 10)
    assert ei.value.limit == "max_concurrent_requests" and ei.value.retry_after_s == 1.0
    assert rl.available_tokens(acme) == pytest.approx(580)  # rejected request charged nothing
    rl.acquire(globex, 10_000).release()  # globex: no token limit, own counter
    l1.release(used_tokens=10)
    rl.acquire(acme, 10)
    l2.release()


# ---------------------------------------------------------------- fair admission


def test_burst_from_one_tenant_does_not_starve_another():
    async def scenario():
        adm = FairAdmission(capacity=1, max_queue_per_tenant=32)
        await adm.acquire("A")  # A holds the only slot
        tasks = [asyncio.create_task(adm.acquire("A")) for _ in range(20)]
        await asyncio.sleep(0)
        tb = asyncio.create_task(adm.acquire("B"))
        await asyncio.sleep(0)
        assert adm.queued("A") == 20 and adm.queued("B") == 1
        adm.release("A")
        await asyncio.sleep(0)
        assert tb.done() and adm.running_for("B") == 1  # B next, not after A's 20
        adm.release("B")
        for _ in range(20):
            await asyncio.sleep(0)
            adm.release("A")
        await asyncio.gather(*tasks)
        return adm.admitted_order

    order = asyncio.run(scenario())
    assert order[:3] == ["A", "B", "A"] and order.count("A") == 21


def test_round_robin_shares_slots_and_queue_overflow():
    async def scenario():
        adm = FairAdmission(capacity=4, max_queue_per_tenant=3)
        for _ in range(4):
            await adm.acquire("A")
        waiting = [asyncio.create_task(adm.acquire("A")) for _ in range(3)]
        waiting += [asyncio.create_task(adm.acquire("B")) for _ in range(2)]
        waiting += [asyncio.create_task(adm.acquire("C")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhaustedError) as ei:
            await adm.acquire("A")  # A's queue (3) is full
        assert ei.value.limit == "max_queued_requests"
        for _ in range(3):
            adm.release("A")
        await asyncio.sleep(0)
        # the freed slots go to the tenants holding fewest (B, C); at equal shares the
        # least recently served (A) is next
        return adm.admitted_order[4:], {t: adm.running_for(t) for t in "ABC"}, waiting

    order, running, waiting = asyncio.run(scenario())
    assert order == ["B", "C", "A"]
    assert running == {"A": 2, "B": 1, "C": 1}


def test_slot_context_manager_and_cancellation():
    async def scenario():
        adm = FairAdmission(capacity=1)
        async with adm.slot("A"):
            t = asyncio.create_task(adm.acquire("B"))
            await asyncio.sleep(0)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert adm.queued() == 0
        assert adm.running == 0
        async with adm.slot("B"):
            assert adm.running_for("B") == 1

    asyncio.run(scenario())


def test_weights_give_proportional_shares():
    async def scenario():
        adm = FairAdmission(capacity=3, weights={"A": 2.0})
        holders = []
        for t in ["A", "A", "B"] * 4:
            holders.append(asyncio.create_task(adm.acquire(t)))
        await asyncio.sleep(0)
        return {t: adm.running_for(t) for t in "AB"}

    assert asyncio.run(scenario()) == {"A": 2, "B": 1}


def test_cancel_after_grant_hands_the_slot_on():
    async def scenario():
        adm = FairAdmission(capacity=1)
        await adm.acquire("A")
        tb = asyncio.create_task(adm.acquire("B"))
        tc = asyncio.create_task(adm.acquire("C"))
        await asyncio.sleep(0)
        adm.release("A")  # grants B's future...
        tb.cancel()  # ...but B is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await tb
        await tc  # the slot went on to C
        return adm.running_for("B"), adm.running_for("C")

    assert asyncio.run(scenario()) == (0, 1)
