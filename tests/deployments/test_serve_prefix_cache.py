"""Automatic prefix caching of the served replicas (``AppConfig.prefix_cache_entries``,
:mod:`deployments.prefix_caching`), a tiny shape-invariant (bfloat16) pair: without Ray, a draft
replica against a target replica whose TP rank runs in process (the served tests' ``Rank``);
then once through Ray Serve (the last test; TP=2: tests/deployments/test_tp_worker.py).

Two greedy requests sharing a prefix give the target alone's ids, and the second starts from
the first's cached prefix on both models (one hit each, exactly the shared positions copied),
counted in the ``specdec_prefix_cache_*`` metrics; an idle-swept session is kept for the next
one; float32 runs without it; a negative entry count is refused by the config.
``prefix_cache_scope``: under "tenant" (the default) two tenants sending the same prompt share
no position on the draft or on any target rank, under "shared" exactly the prompt but its last
token; a ``cache_salt`` shares only with the same salt.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from pydantic import ValidationError

from deployments import convert
from deployments.config import AppConfig
from deployments.draft import Draft
from deployments.metrics import SpecDecMetrics
from deployments.prefix_caching import prefix_stats, serve_prefix_cache
from deployments.target import Target
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.prefix_cache import disable_prefix_cache, prefix_cache_of
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.request import SamplingParams
from specdec.testing.tiny import build_tiny_model
from specdec.types import DraftBlock
from tests.deployments.test_target_sweep import Clock, Rank, _open_block

#: what both requests' prompts share (a chat template's opening), then each its own question
COMMON = [1, 5, 9, 33, 70, 100, 7, 8, 250, 3, 41, 42]
PROMPTS = [COMMON + [60, 61, 62, 63], COMMON + [90, 91, 92]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target folder, draft folder): the draft is the target plus noise (agrees often, not always)."""
    root = tmp_path_factory.mktemp("prefixserve")
    t = build_tiny_model(root / "target", seed=0)
    d = build_tiny_model(root / "draft", seed=1, base=load_model(HFModelSpec(kind="hf", path=t),
                                                                 weight_format="float32").model, noise=0.03)
    return str(t), str(d)


def _load(folder: str, fmt: str):
    return load_model(HFModelSpec(kind="hf", path=folder), weight_format=fmt)


def _job(sid: str, prompt: list[int], max_tokens: int = 16, proposer: int = pb.PROPOSER_DRAFT, tenant: str = "",
         cache_salt: str | None = None) -> xpb.DraftJob:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens, ignore_eos=True,
                             speculation=pb.SpeculationHints(proposer=proposer, max_k=4))
    req.sampling.seed = 5
    if cache_salt is not None:
        req.cache_salt = cache_salt
    return xpb.DraftJob(session_id=sid, request=req, tenant=tenant)


def test_served_requests_sharing_a_prefix_start_from_it_and_equal_the_target_alone(pair):
    t, d = pair
    cfg = AppConfig(target_model=t, draft_model=d, cpu_threads=1, target_dtype="bfloat16", draft_dtype="bfloat16",
                    prefix_cache_entries=4, batch_window_s=0.0, batch_fill_wait_s=0.0)
    target = _load(t, "bfloat16")
    assert target.invariant
    # what TPWorker.setup does with cfg.prefix_cache_entries on its rank's model
    store = serve_prefix_cache(target, cfg.prefix_cache_entries, "target")
    assert store is prefix_cache_of(target.model) and store.entries == 4 and store.live
    rank = Rank(target)
    t_metrics, d_metrics = SpecDecMetrics(backend=None), SpecDecMetrics(backend=None)
    try:
        replica = Target(cfg, workers=[rank], metrics=t_metrics)

        async def main():
            loop = asyncio.get_running_loop()

            def send(method: str, payload: bytes) -> bytes:  # from the draft replica's step threads
                call = replica.Verify(payload) if method == "Verify" else replica.CloseSession(payload)
                return asyncio.run_coroutine_threadsafe(call, loop).result(timeout=300)

            draft = Draft(cfg, send_factory=lambda key: send, metrics=d_metrics)
            outs, stats = [], []
            for i, prompt in enumerate(PROMPTS):  # one after the other: the first is closed when the second opens
                raws = [raw async for raw in draft.Generate(_job(f"s{i}", prompt).SerializeToString())]
                outs.append(convert.join_chunks([pb.GenerateStreamChunk.FromString(r) for r in raws]))
                stats.append((await replica.PrefixCacheStats(), await draft.PrefixCacheStats()))
            return outs, stats, draft

        outs, stats, draft = asyncio.run(main())
    finally:
        disable_prefix_cache(target.model)
    alone = SpeculativeEngine(_load(t, "bfloat16"))  # the target alone, no prefix cache
    for prompt, got in zip(PROMPTS, outs):
        expected = alone.generate(convert.request_from_proto(_job("ref", prompt, proposer=pb.PROPOSER_NONE).request))
        assert list(got.token_ids) == expected.token_ids and len(expected.token_ids) == 16
    assert outs[0].stats.proposed > 0  # the draft really drafted
    # the first request found nothing; the second copied exactly the shared prefix on both models
    first, second = stats
    assert first == ({"enabled": True, "entries": 4, "held": 1, "hits": 0, "shared_positions": 0},
                     {"enabled": True, "entries": 4, "held": 1, "hits": 0, "shared_positions": 0})
    assert second == ({"enabled": True, "entries": 4, "held": 2, "hits": 1, "shared_positions": len(COMMON)},
                      {"enabled": True, "entries": 4, "held": 2, "hits": 1, "shared_positions": len(COMMON)})
    assert len(rank.table) == 0 and draft.Sessions() == []  # both sessions closed and retired
    for metrics, model in ((t_metrics, "target"), (d_metrics, "draft")):
        assert metrics.value("specdec_prefix_cache_hits", model=model) == 1
        assert metrics.value("specdec_prefix_cache_shared_positions", model=model) == len(COMMON)


#: (tenant, cache_salt) of four requests with the same prompt, one after the other
TENANT_JOBS = [("team-a", None), ("team-b", None), ("team-a", None), ("team-a", "salt-1")]


@pytest.mark.parametrize("scope, expected", [
    # per request: (hits, positions copied) on the target's ranks and on the draft replica; a copy is
    # the prompt but its last token (15 of 16): team-b never reuses team-a's prefix under "tenant"
    ("tenant", [(0, 0), (0, 0), (1, 15), (0, 0)]),
    ("shared", [(0, 0), (1, 15), (1, 15), (0, 0)]),
])
def test_prefix_cache_scope_keeps_tenants_apart_on_every_rank_and_the_draft(pair, scope, expected):
    """``AppConfig.prefix_cache_scope``: the same prompt from team-a, team-b, team-a again, then
    team-a with a ``cache_salt``. Under "tenant" (the default) team-b's request copies nothing
    from team-a's on the draft replica and on either of the target's two ranks (each rank its own
    model and prefix cache, as at TP=2, fed the same blocks), team-a's second copies its first's;
    under "shared" team-b copies team-a's as well. A salted request copies from no unsalted one.
    Every output is the bfloat16 target alone's, and both ranks hold the same counts."""
    t, d = pair
    assert AppConfig().prefix_cache_scope == "tenant"
    cfg = AppConfig(target_model=t, draft_model=d, cpu_threads=1, target_dtype="bfloat16", draft_dtype="bfloat16",
                    prefix_cache_entries=4, prefix_cache_scope=scope, batch_window_s=0.0, batch_fill_wait_s=0.0)
    rank_models = [_load(t, "bfloat16"), _load(t, "bfloat16")]
    for m in rank_models:
        serve_prefix_cache(m, cfg.prefix_cache_entries, "target")
    prompt = PROMPTS[0]
    t_metrics, d_metrics = SpecDecMetrics(backend=None), SpecDecMetrics(backend=None)
    try:
        replica = Target(cfg, workers=[Rank(m) for m in rank_models], metrics=t_metrics)

        async def main():
            loop = asyncio.get_running_loop()

            def send(method: str, payload: bytes) -> bytes:
                call = replica.Verify(payload) if method == "Verify" else replica.CloseSession(payload)
                return asyncio.run_coroutine_threadsafe(call, loop).result(timeout=300)

            draft = Draft(cfg, send_factory=lambda key: send, metrics=d_metrics)
            outs, seen = [], []
            for i, (tenant, salt) in enumerate(TENANT_JOBS):
                job = _job(f"t{i}", prompt, tenant=tenant, cache_salt=salt)
                raws = [raw async for raw in draft.Generate(job.SerializeToString())]
                outs.append(list(convert.join_chunks([pb.GenerateStreamChunk.FromString(r) for r in raws]).token_ids))
                seen.append([prefix_stats(m.model) for m in rank_models] + [await draft.PrefixCacheStats()])
            await replica.PrefixCacheStats()  # brings the target's counters up to date
            return outs, seen

        outs, seen = asyncio.run(main())
    finally:
        for m in rank_models:
            disable_prefix_cache(m.model)
    alone = SpeculativeEngine(_load(t, "bfloat16")).generate(
        convert.request_from_proto(_job("ref", prompt, proposer=pb.PROPOSER_NONE).request)).token_ids
    assert outs == [alone] * 4 and len(alone) == 16
    assert len(prompt) - 1 == 15
    before = [(0, 0)] * 3
    for i, now in enumerate(seen):
        got = [(s["hits"], s["shared_positions"]) for s in now]
        deltas = [(h - bh, p - bp) for (h, p), (bh, bp) in zip(got, before)]
        assert deltas == [expected[i]] * 3, (i, deltas)  # rank 0, rank 1, draft
        before = got
    hits, positions = sum(h for h, _ in expected), sum(p for _, p in expected)
    for metrics, model in ((t_metrics, "target"), (d_metrics, "draft")):
        assert metrics.value("specdec_prefix_cache_hits", model=model) == hits
        assert metrics.value("specdec_prefix_cache_shared_positions", model=model) == positions


def test_an_unknown_prefix_cache_scope_is_refused():
    with pytest.raises(ValidationError) as e:
        AppConfig(prefix_cache_scope="global")
    (err,) = e.value.errors()
    assert (err["loc"], err["type"], err["msg"]) == (
        ("prefix_cache_scope",), "literal_error", "Input should be 'tenant' or 'shared'")


def test_an_empty_or_non_string_cache_salt_is_refused_naming_the_field():
    from specdec.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        convert.request_from_proto(pb.GenerateRequest(prompt="x", cache_salt=""))
    assert str(e.value) == "invalid request: cache_salt: String should have at least 1 character"
    with pytest.raises(InvalidRequestError) as e:
        convert.request_from_proto(pb.GenerateRequest(prompt="x", cache_salt="s" * 1025))
    assert str(e.value) == "invalid request: cache_salt: String should have at most 1024 characters"
    req = convert.request_from_proto(pb.GenerateRequest(prompt="x", cache_salt="s" * 1024))
    assert req.cache_salt == "s" * 1024
    assert convert.request_to_proto(req).cache_salt == "s" * 1024
    assert not convert.request_to_proto(convert.request_from_proto(pb.GenerateRequest(prompt="x"))).HasField("cache_salt")


def test_an_idle_swept_session_is_kept_for_the_next_one(pair):
    """The target's idle sweep closes a session on every rank like CloseSession: its cache is
    kept, and a session opened later after the same prompt plus one token copies all but the
    last prompt token (the rest, one position, is fed). The health check counts the hit."""
    t, _ = pair
    target = _load(t, "bfloat16")
    serve_prefix_cache(target, 2, "target")
    clock = Clock()
    metrics = SpecDecMetrics(backend=None)
    try:
        replica = Target(AppConfig(target_model="unused", target_session_idle_timeout_s=60, prefix_cache_entries=2),
                         workers=[Rank(target)], clock=clock, metrics=metrics)

        async def main():
            first = xpb.VerificationResult.FromString(await replica.Verify(_open_block("a", COMMON)))
            clock.t += 61
            await replica.check_health()  # sweeps "a"
            held = await replica.PrefixCacheStats()
            second = xpb.VerificationResult.FromString(
                await replica.Verify(_open_block("b", COMMON + list(first.token_ids))))
            await replica.check_health()
            return first, held, second, await replica.PrefixCacheStats()

        first, held, second, after = asyncio.run(main())
    finally:
        disable_prefix_cache(target.model)
    assert held == {"enabled": True, "entries": 2, "held": 1, "hits": 0, "shared_positions": 0}
    # "a" cached COMMON and its first token: "b" (COMMON + that token) copies all of it but its last
    assert after == {"enabled": True, "entries": 2, "held": 1, "hits": 1, "shared_positions": len(COMMON)}
    assert metrics.value("specdec_prefix_cache_hits", model="target") == 1
    assert metrics.value("specdec_prefix_cache_shared_positions", model="target") == len(COMMON)
    alone = SpeculativeEngine(_load(t, "bfloat16")).verifier.open_session(COMMON, SamplingParams(), 0)
    expected = [alone.verify(DraftBlock.empty()).token_ids[0] for _ in range(2)]
    assert [first.token_ids[0], second.token_ids[0]] == expected


def test_a_cancelled_generation_leaves_its_caches_to_the_next_request(pair):
    """A stream cancelled mid-way (what Serve does when the caller cancels) closes both sessions
    as an ended one does: the next request with the same prompt starts from their caches on both
    models (the prompt but its last token) and still gives the target alone's ids."""
    from tests.deployments.test_draft import Wire

    t, d = pair
    target = _load(t, "bfloat16")
    serve_prefix_cache(target, 4, "target")
    wire = Wire(target)
    cfg = AppConfig(target_model=t, draft_model=d, cpu_threads=1, target_dtype="bfloat16", draft_dtype="bfloat16",
                    prefix_cache_entries=4)
    rep = Draft(cfg, send_factory=lambda key: wire.send, metrics=SpecDecMetrics(backend=None))
    prompt = PROMPTS[0]

    async def run():
        agen = rep.Generate(_job("c1", prompt, max_tokens=60).SerializeToString())
        await agen.__anext__()
        await agen.aclose()
        held = (prefix_stats(target.model), await rep.PrefixCacheStats())
        raws = [raw async for raw in rep.Generate(_job("c2", prompt).SerializeToString())]
        return held, convert.join_chunks([pb.GenerateStreamChunk.FromString(r) for r in raws])

    try:
        held, got = asyncio.run(run())
        after = (prefix_stats(target.model), asyncio.run(rep.PrefixCacheStats()))
    finally:
        disable_prefix_cache(target.model)
    assert [(s["held"], s["hits"]) for s in held] == [(1, 0), (1, 0)] and len(wire.table) == 0
    assert [(s["hits"], s["shared_positions"]) for s in after] == [(1, len(prompt) - 1), (1, len(prompt) - 1)]
    expected = SpeculativeEngine(_load(t, "bfloat16")).generate(
        convert.request_from_proto(_job("ref", prompt, proposer=pb.PROPOSER_NONE).request))
    assert list(got.token_ids) == expected.token_ids


def test_float32_runs_without_prefix_caching_and_says_so(pair, caplog):
    t, _ = pair
    plain = _load(t, "float32")
    assert not plain.invariant
    with caplog.at_level(logging.INFO, logger="deployments.prefix_caching"):
        assert serve_prefix_cache(plain, 8, "target") is None
    assert [r.getMessage() for r in caplog.records] == [
        "prefix caching off for the target: its float32 forward is not shape-invariant (copied keys and values "
        "could differ in the last bits from computed ones); set prefix_cache_entries: 0 to silence this line"]
    assert prefix_stats(plain.model) == {"enabled": False, "entries": 0, "held": 0, "hits": 0, "shared_positions": 0}
    invariant = _load(t, "bfloat16")
    assert serve_prefix_cache(invariant, 0, "target") is None and prefix_cache_of(invariant.model) is None


def test_draft_replica_without_draft_batching_copies_only_from_closed_sessions(pair):
    """Without draft_batching the draft's sessions are fed from their own threads: a live
    session's cache may be cut and overwritten while another copies it."""
    t, d = pair
    base = dict(target_model=t, draft_model=d, cpu_threads=1, draft_dtype="bfloat16", prefix_cache_entries=3)
    batched = Draft(AppConfig(**base), send_factory=lambda key: None)
    alone = Draft(AppConfig(**base, draft_batching=False), send_factory=lambda key: None)
    assert prefix_cache_of(batched.draft_proposer.draft.model).live is True
    assert prefix_cache_of(alone.draft_proposer.draft.model).live is False
    assert asyncio.run(alone.PrefixCacheStats()) == {"enabled": True, "entries": 3, "held": 0, "hits": 0,
                                                     "shared_positions": 0}
    off = Draft(AppConfig(**base | {"prefix_cache_entries": 0}), send_factory=lambda key: None)
    assert asyncio.run(off.PrefixCacheStats())["enabled"] is False


def test_a_negative_entry_count_is_refused():
    with pytest.raises(ValidationError) as e:
        AppConfig(prefix_cache_entries=-1)
    (err,) = e.value.errors()
    assert (err["loc"], err["type"], err["msg"]) == (
        ("prefix_cache_entries",), "greater_than_equal", "Input should be greater than or equal to 0")


@pytest.mark.serve
def test_served_through_ray_serve_the_second_request_starts_from_the_first(models):
    """The application on Ray Serve (one Target replica with its TP rank actor, one Draft replica),
    the tiny pair in bfloat16 and ``prefix_cache_entries`` at its default (8): of two greedy gRPC
    requests sharing 12 prompt tokens, one after the other, the second starts from the first's
    cached prefix on the target's rank and on the draft replica (one hit each, exactly 12
    positions; ``PrefixCacheStats`` through the deployment handles), and both outputs are the
    bfloat16 target alone's. Then tenant beta sends the first prompt again: under the default
    ``prefix_cache_scope`` "tenant" it copies nothing of alpha's (0 hits on both), and alpha
    sending it once more copies its own first request's prefix (the prompt but its last token)."""
    import grpc
    from ray import serve

    from protos.specdec.v1 import specdec_pb2_grpc as pb_grpc
    from tests.deployments.serving import (APP, KEYS, MD, deployment_handle, serve_tiny_app, wait_no_sessions,
                                           wait_running)

    prompts = [COMMON + [40, 41, 42], COMMON + [80, 81]]
    alone = SpeculativeEngine(_load(models[0], "bfloat16"))
    expected = [alone.generate(convert.request_from_proto(_job("ref", p, 12, pb.PROPOSER_NONE).request)).token_ids
                for p in prompts]
    beta = (("application", APP), ("authorization", f"Bearer {KEYS['beta']}"))
    with serve_tiny_app(models, target_tp=1, target_dtype="bfloat16", draft_dtype="bfloat16") as cfg:
        assert cfg.prefix_cache_entries == 8 and cfg.prefix_cache_scope == "tenant"
        wait_running(serve, "specdec")
        channel = grpc.insecure_channel(f"localhost:{cfg.grpc_port}")
        stub = pb_grpc.SpecDecStub(channel)

        def stats():
            return [deployment_handle(name).PrefixCacheStats.remote().result(timeout_s=30)
                    for name in ("Target", "Draft")]

        before = stats()
        assert [(s["enabled"], s["entries"], s["hits"]) for s in before] == [(True, 8, 0), (True, 8, 0)]
        got, deltas = [], []
        for prompt, md in ((prompts[0], MD), (prompts[1], MD), (prompts[0], beta), (prompts[0], MD)):
            req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=12, ignore_eos=True,
                                     speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
            got.append(list(stub.Generate(req, metadata=md, timeout=120).token_ids))
            assert wait_no_sessions() == ([], [])
            now = stats()
            deltas.append([(n["hits"] - b["hits"], n["shared_positions"] - b["shared_positions"])
                           for n, b in zip(now, before)])
            before = now
        channel.close()
    assert got == expected + [expected[0]] * 2
    again = len(prompts[0]) - 1  # alpha's own first request: the prompt but its last token
    assert deltas == [[(0, 0), (0, 0)], [(1, len(COMMON)), (1, len(COMMON))], [(0, 0), (0, 0)],
                      [(1, again), (1, again)]]
