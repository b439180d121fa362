"""Resuming a generation on a new draft replica, through the router's real relay, without Ray.

The first draft replica "dies" (Ray's ``ActorDiedError``) right after the router received the
chunk of a chosen speculation step; the router resumes the generation on a fresh replica from
what it holds. The joined output must be the uninterrupted one, token for token (greedy: also
the target alone), for every resume point: after the first step, mid-way, right after a step
whose drafts were all accepted, right after a rejection, and right after a step whose last
tokens were held back (a partial UTF-8 character or a possible stop string: the client then
holds fewer tokens than the step committed, the case that used to diverge under sampling,
because every step's random stream is keyed by the position the step starts from).
"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from deployments import convert
from deployments.config import AppConfig
from deployments.draft import Draft
from deployments.ingress.relay import drained
from deployments.router import Router
from deployments.target_sessions import TargetSessionTable
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.verifier import TargetVerifier
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.testing.tiny import build_tiny_model

#: (weight format, seed of the tiny target's weights); the draft is the target plus noise
STACKS = [("float32", 0), ("float32", 3), ("float32", 7), ("bfloat16", 3)]
PROMPT = [1, 5, 9, 33, 70, 100, 7, 5, 9, 33]
SAMPLED = pb.SamplingParams(temperature=0.9, top_k=40, seed=77)


class RecordingWire:
    """A target replica in process (serialized protos in and out); records every step."""

    def __init__(self, target):
        self.table = TargetSessionTable(TargetVerifier(target))
        #: per OK Verify: (K, accepted, committed length after it)
        self.steps: list[tuple[int, int, int]] = []

    def send(self, method: str, payload: bytes) -> bytes:
        if method == "Verify":
            msg = xpb.CandidateBlock.FromString(payload)
            reply = self.table.handle(msg)
            if reply.status == xpb.VERIFY_STATUS_OK:
                self.steps.append((len(msg.token_ids), reply.accepted, reply.committed_len))
            return reply.SerializeToString()
        sid = xpb.CloseSessionRequest.FromString(payload).session_id
        return xpb.CloseSessionResponse(existed=self.table.close(sid)).SerializeToString()


class _Stream:
    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self.agen.__aiter__()

    def cancel(self):
        pass  # a dead replica has nothing to cancel


class DraftDeployment:
    """The Draft deployment's handle in process: every call runs on a fresh replica; with
    ``die_after`` the first replica dies once it has streamed the chunk of its step
    ``die_after``. Records, per chunk of the first replica, (steps run, ids streamed so far)."""

    def __init__(self, cfg: AppConfig, wire: RecordingWire, die_after: int | None = None):
        self.cfg, self.wire, self.die_after = cfg, wire, die_after
        self.replicas = 0
        self.chunk_steps: list[tuple[int, int]] = []
        self.raws: list[bytes] = []  # every chunk's bytes as the replicas streamed them

    def options(self, **_):
        return self

    @property
    def Generate(self):
        deployment = self

        class _Method:
            @staticmethod
            def remote(payload):
                return _Stream(deployment._generate(payload))

        return _Method

    async def _generate(self, payload: bytes):
        self.replicas += 1
        first = self.replicas == 1
        replica = Draft(self.cfg, send_factory=lambda key: self.wire.send)
        start, sent = len(self.wire.steps), 0
        async for raw in replica.Generate(payload):
            self.raws.append(raw)
            yield raw
            steps = len(self.wire.steps) - start
            sent += len(pb.GenerateStreamChunk.FromString(raw).token_ids)
            if first:
                self.chunk_steps.append((steps, sent))
            if first and self.die_after is not None and steps >= self.die_after:
                raise ActorDiedError()


@pytest.fixture(scope="module", params=STACKS, ids=[f"{f}-seed{s}" for f, s in STACKS])
def stack(request, tmp_path_factory):
    fmt, seed = request.param
    root = tmp_path_factory.mktemp(f"resume-{fmt}-{seed}")
    t = build_tiny_model(root / "target", seed=seed)
    spec = HFModelSpec(kind="hf", path=t)
    d = build_tiny_model(root / "draft", seed=100 + seed, base=load_model(spec, weight_format="float32").model,
                         noise=0.03)
    target = load_model(spec, weight_format=fmt)
    cfg = AppConfig(target_model=str(t), draft_model=str(d), cpu_threads=1, target_dtype=fmt, draft_dtype=fmt)
    return cfg, target


def _job(proposer: int, sampling: pb.SamplingParams | None) -> xpb.DraftJob:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), max_tokens=40, ignore_eos=True, stop=["zz"],
                             speculation=pb.SpeculationHints(proposer=proposer, max_k=4))
    if sampling is not None:
        req.sampling.CopyFrom(sampling)
        req.logprobs, req.top_logprobs = True, 2
    else:
        req.sampling.seed = 5  # the router always sets one
    return xpb.DraftJob(session_id="s1", request=req)


def _relay(cfg: AppConfig, deployment: DraftDeployment, job: xpb.DraftJob) -> pb.GenerateResponse:
    router = Router(cfg, draft=deployment, gate=object())

    async def run():
        chunks = [c async for c in router._relay(job, "s1")]
        await drained()  # the rest of the draft's stream, read after the final chunk
        return chunks

    chunks = asyncio.run(run())
    assert router.resumes == (0 if deployment.die_after is None else 1)
    # the draft replica's checkpoint trailer never reaches the client
    def trailer(raw: bytes) -> xpb.DraftChunkTrailer:
        msg = xpb.DraftChunkTrailer.FromString(raw)
        msg.DiscardUnknownFields()  # the chunk's own fields
        return msg

    assert all(trailer(c.SerializeToString()).ByteSize() == 0 for c in chunks)
    assert all(trailer(raw).steps > 0 for raw in deployment.raws[:-1])  # every chunk but the last has one
    return convert.join_chunks(chunks)


def _resume_points(wire: RecordingWire, chunk_steps: list[tuple[int, int]]) -> dict[str, int]:
    """Steps after which the first replica dies, by kind (only steps that streamed a chunk)."""
    prompt = len(PROMPT)
    live = chunk_steps[:-1]  # the last chunk ends the generation
    points: dict[str, int] = {}

    def first(kind, cond):
        for steps, sent in live:
            k, acc, committed = wire.steps[steps - 1]
            if cond(k, acc, committed - prompt, sent):
                points.setdefault(kind, steps)
                return

    first("after-first-chunk", lambda *_: True)
    if live:
        points["midway"] = live[len(live) // 2][0]
    first("after-full-accept", lambda k, acc, c, s: k > 0 and acc == k)
    first("after-rejection", lambda k, acc, c, s: acc < k)
    first("tokens-held-back", lambda k, acc, c, s: s < c)
    return points


@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("proposer", [pb.PROPOSER_DRAFT, pb.PROPOSER_NGRAM], ids=["draft", "ngram"])
def test_resume_after_a_replica_death_gives_the_uninterrupted_output(stack, proposer, sampling):
    cfg, target = stack
    wire = RecordingWire(target)
    whole = DraftDeployment(cfg, wire)
    full = _relay(cfg, whole, _job(proposer, sampling))
    assert len(full.token_ids) == 40
    if sampling is None:  # greedy: the target alone
        alone = _job(pb.PROPOSER_NONE, None)
        alone.request.speculation.max_k = 0
        expected = SpeculativeEngine(target).generate(convert.request_from_proto(alone.request))
        assert list(full.token_ids) == expected.token_ids
    points = _resume_points(wire, whole.chunk_steps)
    assert {"after-first-chunk", "midway"} <= set(points)
    for kind, step in points.items():
        wire.steps.clear()
        dying = DraftDeployment(cfg, wire, die_after=step)
        got = _relay(cfg, dying, _job(proposer, sampling))
        assert (kind, list(got.token_ids)) == (kind, list(full.token_ids))
        assert (kind, got.text, got.usage.completion_tokens) == (kind, full.text, 40)
        if sampling is not None:
            assert list(got.logprobs) == pytest.approx(list(full.logprobs), abs=1e-4)
            assert [list(row.ids) for row in got.top_logprobs] == [list(row.ids) for row in full.top_logprobs]


def test_a_replica_death_after_the_final_chunk_is_not_resumed(stack, caplog):
    """The first draft replica dies right after streaming its final chunk: the generation was
    complete; it is not resumed (a resume from the whole output would stream a second final
    chunk), the death only logged at DEBUG."""
    import logging

    cfg, target = stack
    wire = RecordingWire(target)
    whole = DraftDeployment(cfg, wire)
    full = _relay(cfg, whole, _job(pb.PROPOSER_DRAFT, None))
    dying = DraftDeployment(cfg, wire, die_after=whole.chunk_steps[-1][0])
    router = Router(cfg, draft=dying, gate=object())

    async def run():
        chunks = [c async for c in router._relay(_job(pb.PROPOSER_DRAFT, None), "s1")]
        await drained()
        return chunks

    with caplog.at_level(logging.DEBUG, logger="deployments.ingress.relay"):
        chunks = asyncio.run(run())
    assert (router.resumes, dying.replicas) == (0, 1)
    assert [c.finish_reason != pb.FINISH_REASON_UNSPECIFIED for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert list(convert.join_chunks(chunks).token_ids) == list(full.token_ids)
    logged = [r.getMessage() for r in caplog.records if r.name == "deployments.ingress.relay"]
    assert logged == ["s1: the draft replica died after the final chunk (ActorDiedError)"]


def _served_concurrently(cfg: AppConfig, target, jobs: list[xpb.DraftJob], batching: bool):
    """Run ``jobs`` at once on one draft replica (drafting batched) against a Target replica with
    ``target_batching`` on or off (its TP rank in process); the joined responses and BatchStats."""
    from deployments.target import Target
    from tests.deployments.test_target_sweep import Rank

    replica = Target(AppConfig(target_model="unused", target_batching=batching, batch_window_s=0.01,
                               max_batch_positions=64), workers=[Rank(target)])

    async def main():
        loop = asyncio.get_running_loop()

        def send(method: str, payload: bytes) -> bytes:  # from the draft replica's step threads
            call = replica.Verify(payload) if method == "Verify" else replica.CloseSession(payload)
            return asyncio.run_coroutine_threadsafe(call, loop).result(timeout=300)

        draft = Draft(cfg, send_factory=lambda key: send)

        async def one(job):
            raws = [raw async for raw in draft.Generate(job.SerializeToString())]
            return convert.join_chunks([pb.GenerateStreamChunk.FromString(r) for r in raws])

        return await asyncio.gather(*[one(j) for j in jobs]), await replica.BatchStats()

    return asyncio.run(main())


def test_seeded_sampled_outputs_do_not_depend_on_target_batching(stack):
    """Four seeded sampled requests at once (draft and prompt lookup, K 1..4, prompts of 4..30
    tokens): the same tokens with the target's batching on and off, and as each alone in process."""
    cfg, target = stack
    prompts = [PROMPT, PROMPT * 3, PROMPT[:4], PROMPT[::-1] * 2]
    specs = [(pb.PROPOSER_DRAFT, 4, 0.9), (pb.PROPOSER_DRAFT, 2, 1.0), (pb.PROPOSER_NGRAM, 4, 0.9),
             (pb.PROPOSER_DRAFT, 1, 0.7)]
    jobs = []
    for i, (prompt, (proposer, k, temp)) in enumerate(zip(prompts, specs)):
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=24, ignore_eos=True,
                                 speculation=pb.SpeculationHints(proposer=proposer, max_k=k),
                                 sampling=pb.SamplingParams(temperature=temp, top_k=40, seed=11 + i))
        jobs.append(xpb.DraftJob(session_id=f"b{i}", request=req))
    batched, stats = _served_concurrently(cfg, target, jobs, batching=True)
    unbatched, none = _served_concurrently(cfg, target, jobs, batching=False)
    assert stats["max_rows"] >= 2 and none["forwards"] == 0  # really batched, really not
    draft = load_model(HFModelSpec(kind="hf", path=cfg.draft_model), weight_format=cfg.draft_dtype)
    engine = SpeculativeEngine(target, draft)
    alone = [engine.generate(convert.request_from_proto(j.request)).token_ids for j in jobs]
    assert [list(r.token_ids) for r in batched] == alone
    assert [list(r.token_ids) for r in unbatched] == alone


def test_a_relay_cancelled_twice_leaves_no_task_exception_unretrieved():
    """Serve may cancel the router's task twice: the second cancellation left the relay's wait
    for the next chunk before that wait's task ended; the stream, cancelled by the relay, then
    ended the task with Serve's RequestCancelledError, logged as "Task exception was never
    retrieved" for a normal disconnect. The exception is retrieved now."""
    import gc

    from deployments.ingress.relay import _next_chunk

    class RequestCancelledError(Exception):  # as Serve's stream raises once cancelled
        pass

    class Stream:
        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(0.05)  # Serve's stream ends a moment later
                raise RequestCancelledError("request cancelled") from None

    unretrieved = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
        task = asyncio.ensure_future(_next_chunk(Stream(), None, asyncio.Event()))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()  # the second cancellation, while the relay waits for the stream's task
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # the stream's task ends with its error
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert unretrieved == []
