"""A generation continued from a checkpoint (prompt + committed tokens, step count, seed) in a
fresh set of sessions gives the uninterrupted output token for token, and its stream continues
exactly after what the first run had streamed: greedy and seeded sampling (with logprobs),
draft and prompt lookup, float32 and bfloat16, tiny models of several seeds, and every kind of
resume point (after the first step, mid-way, after a full accept, after a rejection, after a
step whose last tokens were held back)."""

from __future__ import annotations

import pytest
import torch

from specdec.control.controller import k_schedule
from specdec.engine.engine import SpeculativeEngine
from specdec.errors import InvalidRequestError
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.request import GenerationRequest
from specdec.testing.tiny import build_tiny_model

STACKS = [("float32", 0), ("float32", 3), ("float32", 7), ("bfloat16", 3)]
PROMPT = [1, 5, 9, 33, 70, 100, 7, 5, 9, 33]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as a served replica with one CPU (tiny models: threads only contend)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=STACKS, ids=[f"{f}-seed{s}" for f, s in STACKS])
def engine(request, tmp_path_factory):
    fmt, seed = request.param
    root = tmp_path_factory.mktemp(f"ckpt-{fmt}-{seed}")
    t = build_tiny_model(root / "target", seed=seed)
    base = load_model(HFModelSpec(kind="hf", path=t), weight_format="float32").model
    d = build_tiny_model(root / "draft", seed=100 + seed, base=base, noise=0.03)
    return SpeculativeEngine(load_model(HFModelSpec(kind="hf", path=t), weight_format=fmt),
                             load_model(HFModelSpec(kind="hf", path=d), weight_format=fmt))


def _request(proposer: str, sampled: bool, seed: int | None = 77) -> GenerationRequest:
    sampling = {"temperature": 0.9, "top_k": 40, "seed": seed} if sampled else {"temperature": 0.0}
    return GenerationRequest(prompt_token_ids=PROMPT, max_tokens=40, ignore_eos=True, stop=["zz"],
                             logprobs=sampled, top_logprobs=2 if sampled else 0, sampling=sampling,
                             speculation={"proposer": proposer, "k": 4})


def _run_with_checkpoints(engine, request):
    """Step the generation to its end; per step (but the last): (checkpoint, chunks so far, K, accepted)."""
    gen = engine.start(request)
    chunks, points = [], []
    while True:
        before = gen.stats.steps
        proposed, accepted = gen.stats.proposed, gen.stats.accepted
        chunk = gen.step()
        if chunk is not None:
            chunks.append(chunk)
            if chunk.finish_reason is not None:
                return gen.result(), chunks, points
        if gen.stats.steps > before and not gen.finished:
            points.append((gen.checkpoint(), len(chunks), gen.stats.proposed - proposed,
                           gen.stats.accepted - accepted))


def _pick(points):
    """Resume points by kind: indices into ``points``."""
    picked = {"first-step": 0, "midway": len(points) // 2}
    for kind, cond in [("after-full-accept", lambda k, a, cp: k > 0 and a == k),
                       ("after-rejection", lambda k, a, cp: a < k),
                       ("tokens-held-back", lambda k, a, cp: cp.sent_ids < len(cp.token_ids))]:
        for i, (cp, _, k, a) in enumerate(points):
            if cond(k, a, cp):
                picked[kind] = i
                break
    return picked


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_resume_from_a_checkpoint_continues_identically(engine, proposer, sampled):
    request = _request(proposer, sampled)
    full, chunks, points = _run_with_checkpoints(engine, request)
    assert len(full.token_ids) == 40
    if not sampled:  # greedy: the target alone
        alone = SpeculativeEngine(engine.target).generate(_request("none", False))
        assert full.token_ids == alone.token_ids
    picked = _pick(points)
    if proposer == "draft":
        assert {"after-rejection", "tokens-held-back"} <= set(picked)
    for kind, i in picked.items():
        cp, n_chunks, _, _ = points[i]
        assert cp.steps == i + 1 and (cp.seed == 77 or not sampled)
        resumed = list(engine.start(request, resume=cp))
        streamed = chunks[:n_chunks] + resumed
        assert (kind, [t for c in streamed for t in c.token_ids]) == (kind, full.token_ids)
        assert (kind, "".join(c.text for c in streamed)) == (kind, full.text)
        assert resumed[-1].finish_reason == full.finish_reason
        if sampled:
            assert [v for c in streamed for v in c.logprobs] == pytest.approx(full.logprobs, abs=1e-4)
            assert [[t for t, _ in row] for c in streamed for row in c.top_logprobs] == \
                   [[t for t, _ in row] for row in full.top_logprobs]


def test_an_unseeded_request_resumes_with_the_checkpoints_seed(engine):
    request = _request("draft", True, seed=None)
    gen = engine.start(request)
    for _ in range(3):
        gen.step()
    cp = gen.checkpoint()
    first = gen.run()
    assert engine.start(request, resume=cp).run().token_ids == first.token_ids
    with pytest.raises(InvalidRequestError, match=f"the checkpoint was taken with seed {cp.seed}, the request has 5"):
        engine.start(_request("draft", True, seed=5), resume=cp)


def test_a_probe_schedule_continues_from_the_checkpoints_step_count(engine):
    """A probe (K for its first 5 steps, then plain decoding) resumed after 3 steps speculates 2 more."""
    request = _request("draft", True)
    gen = engine.start(request, k=k_schedule(4, 5))
    for _ in range(3):
        gen.step()
    cp, proposed = gen.checkpoint(), gen.stats.proposed
    first = gen.run()
    resumed = engine.start(request, k=k_schedule(4, 5 - cp.steps), resume=cp)
    out = resumed.run()
    assert out.token_ids == first.token_ids
    assert resumed.steps == first.stats.steps and out.stats.steps == first.stats.steps - 3
    assert out.stats.proposed == first.stats.proposed - proposed
    speculated = [sum(n for k, n in s.k_counts.items() if k > 0) for s in (first.stats, out.stats)]
    assert speculated == [5, 2]
