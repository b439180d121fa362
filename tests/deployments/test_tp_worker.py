"""Tensor-parallel target workers in Ray actors (gloo on CPU): TP=2 matches TP=1."""

from __future__ import annotations

import pytest
import torch

from deployments import convert
from deployments.target_sessions import TargetSessionTable
from deployments.tp_load import load_tp_model
from deployments.tp_worker import call_all, start_tp_workers
from protos.specdec.v1 import exchange_pb2 as xpb
from specdec.request import SamplingParams
from specdec.testing.tiny import build_tiny_model
from specdec.types import DraftBlock
from specdec.engine.verifier import TargetVerifier

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.serve

PROMPT = [1, 5, 9, 33, 70, 100, 7, 8, 250, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tp") / "target", seed=0))


@pytest.fixture(scope="module")
def tp2(tiny):
    from ray.util.placement_group import placement_group

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # bundle 0 stands for the Serve replica; ranks go in bundles 1..2, all on one node
        pg = placement_group([{"CPU": 0.25}, {"CPU": 0.5}, {"CPU": 0.5}], strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=60)
        workers, infos = start_tp_workers(tiny, 2, pg, first_bundle=1, omp_spin_count=500)
        yield workers, infos
        ray.get([w.shutdown.remote() for w in workers])
    finally:
        ray.shutdown()


def test_weights_are_sharded(tp2):
    _, infos = tp2
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(i["backend"] == "gloo" and i["q_proj_local_shape"] == (32, 64) for i in infos)  # 64 rows split in 2
    assert not any(i["lean_decode"] for i in infos)  # sharded layers keep transformers' forward (its TP hooks)


def test_worker_processes_sleep_idle_openmp_threads(tp2):
    """Each rank's process starts with OMP_WAIT_POLICY=PASSIVE and a bounded spin, GOMP_SPINCOUNT
    (deployments.config.model_process_env): with libgomp's default, idle threads spin against the
    draft replica's on the same cores."""
    _, infos = tp2
    assert [i["omp_wait_policy"] for i in infos] == ["PASSIVE", "PASSIVE"]
    assert [i["gomp_spincount"] for i in infos] == ["500", "500"]  # AppConfig.omp_spin_count (default 0: none)
    assert [i["omp_num_threads"] for i in infos] == ["1", "1"]  # threads=0: Ray's value for a fractional actor


def test_tp2_logits_match_tp1(tiny, tp2):
    workers, _ = tp2
    logits = call_all(workers, "forward", PROMPT)  # [T, V]
    ref = load_tp_model(tiny, 0, 1).model
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    diff = (logits - expected).abs().max().item()
    print(f"TP=2 vs TP=1 max abs logit diff: {diff:.3g}")
    assert diff < 1e-4
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # every rank ends with the same full logits, bit for bit: ranks can verify in lockstep
    per_rank = ray.get([w.forward.remote(PROMPT, True) for w in workers])
    assert torch.equal(per_rank[0], per_rank[1])


def _blocks(ref_tokens: list[int]) -> list[DraftBlock]:
    # Drafts agreeing fully, partially and not at all with the target's greedy continuation.
    return [
        DraftBlock(token_ids=torch.tensor(ref_tokens[0:3])),
        DraftBlock(token_ids=torch.tensor([ref_tokens[4], 0, 0])),
        DraftBlock.empty(),
        DraftBlock(token_ids=torch.tensor([0, 0])),
    ]


def test_greedy_verification_over_tp_equals_in_process(tiny, tp2):
    workers, _ = tp2
    local = TargetSessionTable(TargetVerifier(load_tp_model(tiny, 0, 1)))
    # the target's own greedy continuation, as a perfect draft to cut blocks from
    ref = TargetVerifier(load_tp_model(tiny, 0, 1)).open_session(PROMPT, SamplingParams(), seed=0, logprobs=False)
    greedy = []
    while len(greedy) < 12:
        greedy += ref.verify(DraftBlock.empty()).token_ids
    open_msg = convert.session_open_to_proto(PROMPT, SamplingParams(), seed=1, logprobs=True)
    position, first = len(PROMPT), True
    for block in _blocks(greedy):
        msg = convert.draft_block_to_proto(block, "s1", position, open=open_msg if first else None)
        remote = xpb.VerificationResult.FromString(call_all(workers, "verify", msg.SerializeToString()))
        expected = local.handle(msg)
        assert remote.status == xpb.VERIFY_STATUS_OK
        assert (remote.accepted, list(remote.token_ids), remote.committed_len) == (
            expected.accepted, list(expected.token_ids), expected.committed_len)
        assert list(remote.logprobs) == pytest.approx(list(expected.logprobs), abs=1e-4)
        position, first = remote.committed_len, False
        states = ray.get([w.session_state.remote("s1") for w in workers])
        assert states[0] == states[1]  # cache shards in lockstep
    assert position > len(PROMPT) + 4


def test_missing_session_and_position_mismatch(tp2):
    workers, _ = tp2
    msg = convert.draft_block_to_proto(DraftBlock.empty(), "nobody", 10)
    reply = xpb.VerificationResult.FromString(call_all(workers, "verify", msg.SerializeToString()))
    assert reply.status == xpb.VERIFY_STATUS_SESSION_MISSING
    open_msg = convert.session_open_to_proto(PROMPT, SamplingParams(), seed=0, logprobs=False)
    call_all(workers, "verify", convert.draft_block_to_proto(DraftBlock.empty(), "s2", 10, open_msg).SerializeToString())
    stale = convert.draft_block_to_proto(DraftBlock.empty(), "s2", 10)  # a retried step
    reply = xpb.VerificationResult.FromString(call_all(workers, "verify", stale.SerializeToString()))
    assert reply.status == xpb.VERIFY_STATUS_POSITION_MISMATCH and reply.target_position == 11
    assert call_all(workers, "close_session", "s2") is True
    counts = ray.get([w.num_sessions.remote() for w in workers])
    assert counts[0] == counts[1]


def test_batched_verification_over_tp_equals_in_process(tiny, tp2):
    """Three sessions in one batched forward on both ranks: rank 0's replies equal handle()."""
    workers, _ = tp2
    local = TargetSessionTable(TargetVerifier(load_tp_model(tiny, 0, 1)))
    prompts = {"b1": PROMPT, "b2": PROMPT[:3], "b3": PROMPT * 5}
    msgs = [convert.draft_block_to_proto(DraftBlock(token_ids=torch.tensor([5, 6][: i])), sid, len(p),
                                         open=convert.session_open_to_proto(p, SamplingParams(), seed=1, logprobs=False))
            for i, (sid, p) in enumerate(prompts.items())]
    out = call_all(workers, "verify_batch", [(i, m.SerializeToString()) for i, m in enumerate(msgs)], 16)
    assert out["positions"] == 16
    answered = {t: raw for t, raw, _, _ in out["answers"]}
    while len(answered) < 3:  # the 50-token prompt is prefilled in chunks of <= 16 positions
        answered.update({t: raw for t, raw, _, _ in call_all(workers, "verify_batch", [], 16)["answers"]})
    for t, m in enumerate(msgs):
        got, exp = xpb.VerificationResult.FromString(answered[t]), local.handle(m)
        assert (got.accepted, list(got.token_ids), got.committed_len) == (exp.accepted, list(exp.token_ids), exp.committed_len)
    for sid in prompts:
        states = ray.get([w.session_state.remote(sid) for w in workers])
        assert states[0] == states[1]
        call_all(workers, "close_session", sid)


def test_health_probe_does_not_wait_behind_a_forward(tp2):
    workers, _ = tp2
    msgs = [convert.draft_block_to_proto(DraftBlock.empty(), f"h{i}", 240,
                                         open=convert.session_open_to_proto([3 + (i + j) % 200 for j in range(240)],
                                                                            SamplingParams(), seed=1, logprobs=False))
            for i in range(24)]
    busy = [w.verify_batch.remote([(i, m.SerializeToString()) for i, m in enumerate(msgs)], None) for w in workers]
    probes = [w.num_sessions.options(concurrency_group="health").remote() for w in workers]
    ready, _ = ray.wait(probes + busy, num_returns=2, timeout=120)
    assert set(ready) == set(probes)  # both probes answered while the forward still ran
    ray.get(busy)
    for i in range(24):
        call_all(workers, "close_session", f"h{i}")


def test_prefix_caching_over_tp_copies_the_same_positions_on_every_rank(tiny, tp2):
    """Two bfloat16 (shape-invariant) ranks with prefix caching (``AppConfig.prefix_cache_entries``,
    as the Target replica starts them): a session opened while another with the same opening is
    live copies that opening, one opened after a closed one with its prompt copies all of it but
    the last token; both ranks take the same decisions (same statistics, same cache lengths after
    every step), and every session's greedy ids are the target alone's (the argmax of one
    uncached forward over the prompt and the ids before each)."""
    common = [1, 5, 9, 33, 70, 100, 7, 8, 250, 3]
    prompts = {"p1": common + [60, 61, 62], "p2": common + [90, 91], "p3": common + [60, 61, 62]}
    workers, infos = start_tp_workers(tiny, 2, None, dtype="bfloat16", prefix_cache_entries=4)
    try:
        assert [i["prefix_cache_entries"] for i in infos] == [4, 4]
        emittable = load_tp_model(tiny, 0, 1).emittable_vocab
        ticket = iter(range(1000))
        out = {}
        for sid, prompt in prompts.items():
            if sid == "p3":  # p1 closes: p3 starts from its kept cache
                assert call_all(workers, "close_session", "p1") is True
            got, position = [], len(prompt)
            for step in range(6):
                opening = convert.session_open_to_proto(prompt, SamplingParams(), seed=1, logprobs=False)
                msg = convert.draft_block_to_proto(DraftBlock.empty(), sid, position, open=opening if step == 0 else None)
                answers = call_all(workers, "verify_batch", [(next(ticket), msg.SerializeToString())], None)["answers"]
                res = xpb.VerificationResult.FromString(answers[0][1])
                got += list(res.token_ids)
                position = res.committed_len
                states = ray.get([w.session_state.remote(sid) for w in workers])
                assert states[0] == states[1]
            out[sid] = got
        stats = ray.get([w.prefix_cache_stats.remote() for w in workers])
        # p2 copied the 10 shared tokens from live p1; p3 the 12 of p1's prompt it may (not its last)
        assert stats[0] == stats[1] == {"enabled": True, "entries": 4, "held": 1, "hits": 2,
                                        "shared_positions": len(common) + len(prompts["p3"]) - 1}
        for sid, prompt in prompts.items():
            logits = call_all(workers, "forward", prompt + out[sid][:-1])  # [T, V], no cache
            alone = logits[len(prompt) - 1:, :emittable].argmax(-1).tolist()
            assert out[sid] == alone, sid
        assert out["p3"] == out["p1"]
    finally:
        ray.get([w.shutdown.remote() for w in workers])
        for w in workers:
            ray.kill(w)
