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


def test_a_resumed_stream_never_repeats_or_drops_tokens():
    """Streaming resumed after any chunk, from the ids the client holds only (a resume job from
    an older router, nothing held back known): the new assembler counts what was streamed
    (``mark_sent``) and the concatenated stream is the uninterrupted one. Re-sending what the
    re-fed assembler held back again (a token ending in the first character of the stop string)
    used to repeat ids."""
    import random

    from specdec.engine.stopping import OutputAssembler
    from specdec.testing.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    ends_in_z = [i for i in range(3, len(tok)) if tok.decode([i]).endswith("z")]
    assert ends_in_z
    rng = random.Random(0)
    checked = 0
    for _ in range(40):
        ids = [rng.choice(ends_in_z) if rng.random() < 0.3 else rng.randrange(3, len(tok)) for _ in range(30)]
        steps = []
        while sum(map(len, steps)) < len(ids):
            at = sum(map(len, steps))
            steps.append(ids[at:at + rng.randrange(1, 4)])
        full = OutputAssembler(tok, max_tokens=len(ids), stop=["zz"])
        chunks = []
        for s in steps:
            full.add(s)
            chunks.append(full.take_chunk())
        whole_ids = [t for c in chunks if c for t in c.token_ids]
        whole_text = "".join(c.text for c in chunks if c)
        for n in range(1, len(steps)):
            head = [c for c in chunks[:n] if c]
            sent = [t for c in head for t in c.token_ids]
            resumed = OutputAssembler(tok, max_tokens=len(ids), stop=["zz"])
            resumed.add(sent)
            resumed.mark_sent(len(sent), sum(len(c.text) for c in head))
            rest = ids[len(sent):]
            tail = []
            for s in [rest[i:i + 2] for i in range(0, len(rest), 2)]:
                if resumed.finished:
                    break
                resumed.add(s)
                tail.append(resumed.take_chunk())
            tail.append(resumed.take_chunk())
            tail = [c for c in tail if c]
            assert sent + [t for c in tail for t in c.token_ids] == whole_ids
            assert "".join(c.text for c in head + tail) == whole_text
            checked += 1
    assert checked > 300
