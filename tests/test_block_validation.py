"""Validation and numerics of the draft -> target exchange (issue 11).

- the sparse proposal never carries ids outside the emittable vocabulary, also when fewer than
  M ids have non-zero probability (the rest of the row is padding);
- the target checks every block on arrival and refuses a malformed one with a clear
  InvalidRequestError (INVALID_ARGUMENT over gRPC), never an internal error or a silent sample;
- per-(side, seed, position) random streams come from a real hash: seeds that differ only above
  bit 32 differ, and a draft stream never equals a target stream.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from deployments import convert
from deployments.grpc_status import status_for
from deployments.target_sessions import TargetSessionTable
from specdec.engine.engine import SpeculativeEngine
from specdec.errors import InvalidRequestError
from specdec.engine.proposers.draft_model import DraftModelProposer
from specdec.request import GenerationRequest, SamplingParams, SpeculationParams
from specdec.engine.sampling import DRAFT, TARGET, derive_seeds, restrict_support, step_generator, stream_seed
from specdec.testing.tiny import build_tiny_model
from specdec.types import DraftBlock
from specdec.engine.verifier import TargetVerifier, validate_block
from tests.conftest import load_tiny

PROMPT = [5, 17, 42, 9, 100, 7, 23]


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    """Target and draft whose embedding matrices have 384 rows for a 320-token tokenizer."""
    d = tmp_path_factory.mktemp("padded")
    target = load_tiny(build_tiny_model(d / "t", seed=0, vocab_rows=384))
    draft = load_tiny(build_tiny_model(d / "d", seed=1, vocab_rows=384, base=target.model, noise=0.03))
    assert target.emittable_vocab == draft.emittable_vocab == 320
    return target, draft


# --- the sparse proposal stays in the vocabulary -----------------------------------------------


def test_restrict_support_pads_with_emittable_ids():
    probs = torch.zeros(2, 100)
    probs[0, [2, 5, 7]] = torch.tensor([0.5, 0.3, 0.2])
    probs[1, 40] = 1.0
    ids, q = restrict_support(probs, 64, emittable=50)
    assert ids.shape == q.shape == (2, 50)  # M clipped to the 50 emittable ids
    assert int(ids.max()) < 50
    assert ids[0, :3].tolist() == [2, 5, 7] and q[0, :3].tolist() == pytest.approx([0.5, 0.3, 0.2])
    assert ids[1, 0] == 40 and float(q[1, 0]) == 1.0 and float(q[1, 1:].sum()) == 0.0


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0, top_k=1, seed=1),  # one id with non-zero probability
    SamplingParams(temperature=1.0, top_k=3, seed=2),
    SamplingParams(temperature=1e-6, seed=3),  # low temperature: the argmax only
])
def test_draft_never_proposes_ids_beyond_the_tokenizer(padded_pair, sampling):
    target, draft = padded_pair
    session = DraftModelProposer(draft, top_m=64).open_session(PROMPT, sampling, seed=0)
    for _ in range(4):
        block = session.propose(4)
        assert block.q_ids.shape == (block.k, 64)
        assert int(block.q_ids.max()) < 320, block.q_ids.max()
        validate_block(block, target.emittable_vocab)  # what the target checks on arrival
        session.commit(block.token_ids.tolist())


def test_draft_support_larger_than_the_vocabulary(padded_pair):
    """M above the emittable vocabulary: the row is the whole vocabulary, never padding rows."""
    target, draft = padded_pair
    session = DraftModelProposer(draft, top_m=350).open_session(PROMPT, SamplingParams(temperature=1.0, seed=1), seed=0)
    block = session.propose(3)
    assert block.q_ids.shape == (block.k, 320)
    assert sorted(block.q_ids[0].tolist()) == list(range(320))
    validate_block(block, target.emittable_vocab)


def test_low_temperature_request_through_the_engine(padded_pair):
    """With the checks on arrival, a low-temperature request runs end to end (it became INTERNAL)."""
    target, draft = padded_pair
    req = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=12, ignore_eos=True,
                            sampling=SamplingParams(temperature=1.0, top_k=2, seed=4),
                            speculation=SpeculationParams(proposer="draft", k=4))
    result = SpeculativeEngine(target, draft).generate(req)
    assert len(result.token_ids) == 12 and max(result.token_ids) < 320
    assert result.stats.proposed > 0


# --- the target checks every block ----------------------------------------------------------


def _block(k=2, m=4):
    ids = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])[:k, :m]
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]])[:k, :m]
    return torch.tensor([10, 21])[:k], ids, probs


def _msg(token_ids, q_ids, q_probs, position=len(PROMPT)):
    block = DraftBlock(token_ids=token_ids, q_ids=q_ids, q_probs=q_probs)
    open_ = convert.session_open_to_proto(PROMPT, SamplingParams(temperature=1.0, seed=1), 3, False)
    return convert.draft_block_to_proto(block, "s1", position, open=open_)


def _bad(what):
    t, i, p = _block()
    if what == "q id beyond the vocabulary":
        i[1, 2] = 350
        return (t, i, p), "block q_ids[1][2] = 350 is outside the vocabulary 0..319"
    if what == "token beyond the vocabulary":
        t[1] = 320
        return (t, i, p), "block token_ids[1] = 320 is outside the vocabulary 0..319"
    if what == "nan probability":
        p[0, 1] = float("nan")
        return (t, i, p), "block q_probs[0][1] = nan is not finite"
    if what == "infinite probability":
        p[1, 0] = float("inf")
        return (t, i, p), "block q_probs[1][0] = inf is not finite"
    if what == "negative probability":
        p[1, 3] = -0.1
        p[1, 0] = 0.9
        return (t, i, p), "block q_probs[1][3] = -0.1 is negative"
    if what == "row not summing to 1":
        p[0] = p[0] / 2
        return (t, i, p), "block q_probs row 0 sums to 0.5, not 1 (tolerance 0.001)"
    if what == "token outside its q":
        t[0] = 99
        return (t, i, p), "block token_ids[0] = 99 has probability 0 under its proposal distribution q_probs[0]"
    raise AssertionError(what)


BAD = ["q id beyond the vocabulary", "token beyond the vocabulary", "nan probability",
       "infinite probability", "negative probability", "row not summing to 1", "token outside its q"]


@pytest.mark.parametrize("what", BAD)
def test_target_refuses_a_malformed_block(tiny_target, what):
    (t, i, p), message = _bad(what)
    table = TargetSessionTable(TargetVerifier(tiny_target))
    with pytest.raises(InvalidRequestError) as e:
        table.handle(_msg(t, i, p))
    assert str(e.value).startswith(message), str(e.value)
    assert status_for(e.value) is grpc.StatusCode.INVALID_ARGUMENT
    assert len(table) == 0  # nothing half-open stays behind


def test_negative_ids_are_refused_in_process(tiny_target):
    """Negative ids cannot travel (uint32 on the wire) but can reach an in-process verifier."""
    t, i, p = _block()
    i[0, 3] = -1
    with pytest.raises(InvalidRequestError, match=r"block q_ids\[0\]\[3\] = -1 is outside the vocabulary 0..319"):
        validate_block(DraftBlock(token_ids=t, q_ids=i, q_probs=p), 320)
    session = TargetVerifier(tiny_target).open_session(PROMPT, SamplingParams(temperature=1.0), seed=1)
    with pytest.raises(InvalidRequestError, match=r"block token_ids\[0\] = -3 is outside"):
        session.verify(DraftBlock(token_ids=torch.tensor([-3, 4])))


def test_target_accepts_a_well_formed_block(tiny_target):
    t, i, p = _block()
    reply = TargetSessionTable(TargetVerifier(tiny_target)).handle(_msg(t, i, p))
    assert len(reply.token_ids) == reply.accepted + 1


# --- seeds ------------------------------------------------------------------------------------


def test_stream_seeds_are_32_bit_and_keep_the_sides_apart():
    draft = {stream_seed(DRAFT, s, pos) for s in range(40) for pos in range(60)}
    target = {stream_seed(TARGET, s, pos) for s in range(40) for pos in range(60)}
    assert draft.isdisjoint(target)
    assert len(draft) == len(target) == 40 * 60  # no collision within a side either
    assert max(draft | target) < 2**32  # all of it survives torch's 32-bit mt19937 seeding
    with pytest.raises(ValueError, match="side must be 'draft' or 'target'"):
        stream_seed("verifier", 1, 1)


def test_seeds_that_differ_only_above_bit_32_give_different_streams():
    for side in (DRAFT, TARGET):
        a = torch.rand(8, generator=step_generator(5, 10, side))
        b = torch.rand(8, generator=step_generator(5 + 2**32, 10, side))
        assert not torch.equal(a, b)
    assert derive_seeds(5)[0] != derive_seeds(5 + 2**32)[0]
    assert derive_seeds(5)[1] != derive_seeds(5 + 2**32)[1]


def test_draft_stream_never_equals_the_target_stream_of_a_neighbouring_position():
    """The affine seed mix this replaced let the draft's stream at position P + 1 equal the
    target's at P for a solvable request seed; a hash with the side in the low bit cannot."""
    for seed in (0, 1, 5, 2**40 + 3, 2**63 - 1):
        d, t = derive_seeds(seed)
        for pos in range(50):
            for dp in (pos, pos + 1):
                x = torch.rand(4, generator=step_generator(d, dp, DRAFT))
                y = torch.rand(4, generator=step_generator(t, pos, TARGET))
                assert not torch.equal(x, y)


def test_requests_with_seeds_equal_mod_2_32_differ(tiny_target, tiny_draft_close):
    def run(seed):
        req = GenerationRequest(prompt_token_ids=PROMPT, max_tokens=16, ignore_eos=True,
                                sampling=SamplingParams(temperature=1.0, seed=seed),
                                speculation=SpeculationParams(proposer="draft", k=3))
        return SpeculativeEngine(tiny_target, tiny_draft_close).generate(req).token_ids

    assert run(7) == run(7)
    assert run(7) != run(7 + 2**32)
