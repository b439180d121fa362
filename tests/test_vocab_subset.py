"""The vocabulary-subset draft (FR-Spec, specdec/models/vocab_subset.py): the table and its
tokenizer check, the subset, the sliced output layer in every weight format, and exactness:
greedy output equal to the target alone, sampled output following the target's distribution
(chi-square), q exactly the subset-renormalised distribution, batched drafting and the served
draft replica on the same code path. Tiny models (320-token vocabulary)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec.engine.engine import SpeculativeEngine
from specdec.engine.sampling import warp_probs
from specdec.errors import ModelCompatibilityError, ModelLoadError
from specdec.models.formats import WEIGHT_FORMATS
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.models.vocab_subset import DEFAULT_TABLE, FrequencyTable, expand_logits, subset_ids, tokenizer_identity
from specdec.request import GenerationRequest, SamplingParams
from specdec.testing.tiny import build_tiny_model, build_tiny_tokenizer
from tests.conftest import target_greedy

V = 320


def ranked_table(tokenizer, ranking: list[int]) -> FrequencyTable:
    """A table whose ranking is ``ranking`` (counts falling by one per rank)."""
    return FrequencyTable.from_counts(tokenizer, Counter({i: 10_000 - r for r, i in enumerate(ranking)}), "test")


def shuffled(seed: int) -> list[int]:
    ids = list(range(3, V))
    random.Random(seed).shuffle(ids)
    return ids


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocabsubset")
    target = build_tiny_model(d / "target", seed=0)
    from transformers import AutoModelForCausalLM

    draft = build_tiny_model(d / "draft", seed=1, base=AutoModelForCausalLM.from_pretrained(target), noise=0.03)
    return target, draft


@pytest.fixture(scope="module")
def target(folders):
    return load_model(HFModelSpec(path=folders[0]))


def load_draft(folders, n, table, fmt="float32", **kw):
    return load_model(HFModelSpec(path=folders[1]), weight_format=fmt, vocab_subset=n, vocab_table=table, **kw)


# --- the table ---------------------------------------------------------------------------------


def test_table_round_trip_and_coverage(tmp_path):
    tok = build_tiny_tokenizer()
    table = FrequencyTable.from_texts(tok, ["def add(a, b):\n    return a + b\n"] * 3 + ["for i in range(10):"], "t")
    counts = Counter(tok("def add(a, b):\n    return a + b\n")["input_ids"])
    assert table.counts[0] == 3 * max(counts.values())
    assert sum(table.counts) == 3 * sum(counts.values()) + len(tok("for i in range(10):")["input_ids"])
    table.save(tmp_path / "t.json.gz")
    again = FrequencyTable.load(tmp_path / "t.json.gz")
    assert (again.ranked_ids, again.counts, again.tokenizer) == (table.ranked_ids, table.counts, tokenizer_identity(tok))
    assert again.coverage(len(again.ranked_ids)) == 1.0
    assert (tmp_path / "t.json.gz").read_bytes()[:2] == b"\x1f\x8b"
    table.save(tmp_path / "u.json.gz")  # deterministic bytes (no timestamp)
    assert (tmp_path / "u.json.gz").read_bytes() == (tmp_path / "t.json.gz").read_bytes()


def test_shipped_table_is_refused_for_another_tokenizer():
    table = FrequencyTable.load()
    assert table.name == f"specdec/data/{DEFAULT_TABLE}"
    assert table.tokenizer["vocab_size"] == 151936 and len(table.ranked_ids) > 30_000
    assert all(a >= b for a, b in zip(table.counts, table.counts[1:])) and table.counts[-1] >= 1
    assert len(set(table.ranked_ids)) == len(table.ranked_ids) and max(table.ranked_ids) < 151936
    with pytest.raises(ModelCompatibilityError, match=r"made for another tokenizer \(151936 tokens.*than tiny's \(320 tokens"):
        table.check_tokenizer(build_tiny_tokenizer(), "tiny")
    # same size, other ids: the hash tells them apart
    other = build_tiny_tokenizer(kind="text")
    fake = FrequencyTable(dict(tokenizer_identity(other), vocab_size=V), [5], [1], name="x")
    with pytest.raises(ModelCompatibilityError, match="made for another tokenizer"):
        fake.check_tokenizer(build_tiny_tokenizer())


def test_not_a_table(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "other"}')
    with pytest.raises(ModelLoadError, match="is not a token frequency table"):
        FrequencyTable.load(tmp_path / "x.json")
    with pytest.raises(ModelLoadError, match="cannot read token frequency table"):
        FrequencyTable.load(tmp_path / "missing.json.gz")
    (tmp_path / "cut.json.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 6)  # a gzip header, no body
    with pytest.raises(ModelLoadError, match="cannot read token frequency table"):
        FrequencyTable.load(tmp_path / "cut.json.gz")
    from specdec.models.vocab_subset import TABLE_FORMAT
    import json

    (tmp_path / "partial.json").write_text(json.dumps({"format": TABLE_FORMAT, "tokenizer": {}, "counts": []}))
    with pytest.raises(ModelLoadError, match=r"partial.json is a damaged token frequency table \(KeyError"):
        FrequencyTable.load(tmp_path / "partial.json")
    (tmp_path / "badids.json").write_text(json.dumps({"format": TABLE_FORMAT, "tokenizer": {}, "ranked_ids": ["a"],
                                                      "counts": [1]}))
    with pytest.raises(ModelLoadError, match=r"badids.json is a damaged token frequency table \(ValueError"):
        FrequencyTable.load(tmp_path / "badids.json")


def test_subset_ids_order_and_errors():
    tok = build_tiny_tokenizer()
    table = ranked_table(tok, [50, 7, 300, 9])
    assert subset_ids(table, tok, 3, V, always=[2]).tolist() == [2, 7, 50]  # EOS, then by rank, ascending
    assert subset_ids(table, tok, 7, V, always=[2]).tolist() == [0, 1, 2, 7, 9, 50, 300]  # unranked: id order
    assert subset_ids(table, tok, 2, 100).tolist() == [7, 50]  # ids at or past emittable are skipped
    assert subset_ids(table, tok, V, V).tolist() == list(range(V))
    for bad in (0, -1, V + 1, True, 2.0):
        with pytest.raises(ModelLoadError, match=rf"from 1 to {V} \(the tokens m can emit\), got {bad!r}"):
            subset_ids(table, tok, bad, V, model_name="m")


def test_expand_logits():
    ids = torch.tensor([1, 4])
    out = expand_logits(torch.tensor([[0.5, -1.0], [2.0, 3.0]]), ids, 6)
    inf = float("-inf")
    assert out.tolist() == [[inf, 0.5, inf, inf, -1.0, inf], [inf, 2.0, inf, inf, 3.0, inf]]


# --- the sliced output layer, every format -----------------------------------------------------


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_sliced_output_layer_equals_full_rows(folders, fmt):
    """The subset draft's logits are exactly the full draft's at the subset's columns, in every
    format (int8/int4: sliced before quantizing; both quantize per row, so the rows are the same)."""
    tok = build_tiny_tokenizer()
    table = ranked_table(tok, shuffled(3))
    full = load_model(HFModelSpec(path=folders[1]), weight_format=fmt)
    sub = load_draft(folders, 48, table, fmt)
    assert sub.vocab_subset.tolist() == sorted([2] + shuffled(3)[:47])
    assert sub.model.get_output_embeddings().out_features == 48 and sub.vocab_rows == V
    assert sub.model.get_input_embeddings().weight.shape[0] == V  # every id can still be fed
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.inference_mode():
        a, b = full.model(x).logits[0].float(), sub.model(x).logits[0].float()
    assert b.shape == (7, 48)
    assert torch.equal(a[:, sub.vocab_subset], b)
    assert torch.equal(sub.full_logits(b)[:, sub.vocab_subset], b)
    assert bool(torch.isinf(sub.full_logits(b)).sum() == 7 * (V - 48))


def test_int8_layer_sliced_after_quantizing(folders):
    from specdec.models.vocab_subset import slice_output_layer

    full = load_model(HFModelSpec(path=folders[1]), weight_format="int8")
    ids = torch.tensor([2, 9, 40, 41, 300])
    x = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        a = full.model(x).logits[0].float()
        slice_output_layer(full.model, ids)
        b = full.model(x).logits[0].float()
    assert torch.equal(a[:, ids], b)


def test_load_errors(folders, target):
    tok = build_tiny_tokenizer()
    table = ranked_table(tok, shuffled(3))
    with pytest.raises(ModelLoadError, match=r"int4 .* multiple of 16"):
        load_draft(folders, 40, table, "int4")
    with pytest.raises(ModelLoadError, match=r"from 1 to 320"):
        load_draft(folders, 321, table)
    for n in (-5, 0, 10**9):  # the range error first, in int4 too (not the multiple-of-16 one)
        with pytest.raises(ModelLoadError, match=rf"from 1 to 320 .*got {n}$"):
            load_draft(folders, n, table, "int4")
    with pytest.raises(ModelCompatibilityError, match="made for another tokenizer"):
        load_draft(folders, 64, None)  # the shipped (Qwen) table
    with pytest.raises(ValueError, match="the target must score the full vocabulary"):
        SpeculativeEngine(load_draft(folders, 64, table), None)


# --- exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [16, 128])
def test_greedy_output_is_the_target_alone(folders, target, n):
    """Also when the target's tokens fall outside the subset: the draft then proposes something
    else, the target's token is emitted (correction or bonus) and fed to the draft next step."""
    draft = load_draft(folders, n, ranked_table(build_tiny_tokenizer(), shuffled(5)))
    engine = SpeculativeEngine(target, draft)
    subset = set(draft.vocab_subset.tolist())
    rng = random.Random(1)
    outside = accepted = 0
    for trial in range(4):
        prompt = [rng.randrange(3, V) for _ in range(rng.randrange(1, 30))]
        expected = target_greedy(target, prompt, 24)
        for k in (1, 4):
            res = engine.generate(GenerationRequest(prompt_token_ids=prompt, max_tokens=24,
                                                    speculation={"proposer": "draft", "k": k}))
            assert res.token_ids == expected, (n, trial, k)
            accepted += res.stats.accepted
        outside += sum(t not in subset for t in expected)
    assert outside > 0 and accepted > 0


def _reference_block(draft, ids: list[int], k: int, c: float) -> list[int]:
    """Greedy drafting with early stop computed the long way: the draft's logits widened to the
    full vocabulary (-inf outside the subset), padding ids masked, argmax, softmax probability."""
    from specdec.engine.sampling import mask_unemittable

    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(k):
            logits = draft.model(input_ids=torch.tensor([ids + tokens])).logits[0, -1:].float()
            full = mask_unemittable(draft.full_logits(logits), draft.emittable_vocab)[0]
            token = int(full.argmax())
            tokens.append(token)
            if token in draft.eos_token_ids or float(torch.softmax(full, dim=-1)[token]) < c:
                break
    return tokens


@pytest.mark.parametrize("n", [None, 24, 128])
def test_greedy_early_stop_drafts_from_the_subset_row_without_widening(folders, target, n, monkeypatch):
    """Greedy drafting with early stop takes the argmax and its probability over the draft's own
    row (the subset's N scores, or the emittable ids of a full draft), never building the [1, V]
    widened logits: the same blocks (tokens and where they stop) as the widened computation, and
    the target's output."""
    from specdec.engine.proposers.draft_model import DraftModelProposer
    from specdec.models.loaded import LoadedModel

    draft = (load_model(HFModelSpec(path=folders[1])) if n is None
             else load_draft(folders, n, ranked_table(build_tiny_tokenizer(), shuffled(5))))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, V) for _ in range(rng.randrange(1, 25))] for _ in range(6)]
    expected = {(i, c): _reference_block(draft, p, 6, c) for i, p in enumerate(prompts) for c in (0.2, 0.5)}

    def widened(self, logits):
        raise AssertionError("greedy drafting widened the logits to the full vocabulary")

    monkeypatch.setattr(LoadedModel, "full_logits", widened)
    proposer = DraftModelProposer(draft)
    greedy = SamplingParams(temperature=0.0)
    stops = 0
    for (i, c), want in expected.items():
        session = proposer.open_session(prompts[i], greedy, 0, min_confidence=c)
        got = session.propose(6).token_ids.tolist()
        session.close()
        assert got == want, (n, i, c)
        stops += len(got) < 6
    assert stops > 0  # the early stop fired on some blocks (else the test could not tell)
    engine = SpeculativeEngine(target, draft)
    for p in prompts[:2]:
        res = engine.generate(GenerationRequest(prompt_token_ids=p, max_tokens=16, speculation={
            "proposer": "draft", "k": 4, "draft_min_confidence": 0.3}))
        assert res.token_ids == target_greedy(target, p, 16)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4", "w8a8"])
def test_greedy_identity_in_reduced_formats(folders, fmt):
    tgt = load_model(HFModelSpec(path=folders[0]), weight_format=fmt)
    draft = load_draft(folders, 64, ranked_table(build_tiny_tokenizer(), shuffled(5)), fmt)
    engine = SpeculativeEngine(tgt, draft)
    rng = random.Random(2)
    for _ in range(2):
        prompt = [rng.randrange(3, V) for _ in range(rng.randrange(1, 20))]
        alone = engine.generate(GenerationRequest(prompt_token_ids=prompt, max_tokens=20,
                                                  speculation={"proposer": "none"})).token_ids
        for k in (1, 4):
            res = engine.generate(GenerationRequest(prompt_token_ids=prompt, max_tokens=20,
                                                    speculation={"proposer": "draft", "k": k}))
            assert res.token_ids == alone


def test_q_is_the_subset_renormalised_distribution(folders):
    """What a sampled block carries is the distribution the draft sampled from: the processed and
    warped draft distribution over the subset, zero elsewhere, summing to 1."""
    table = ranked_table(build_tiny_tokenizer(), shuffled(8))
    draft = load_draft(folders, 40, table)
    full = load_model(HFModelSpec(path=folders[1]))
    engine = SpeculativeEngine(full, draft)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    from specdec.engine.processors import LogitProcessing

    prompt = [5, 9, 33, 70]
    subset_list = draft.vocab_subset.tolist()
    processing = LogitProcessing(prompt_len=2, repetition_penalty=1.3, presence_penalty=0.4,
                                 logit_bias={subset_list[3]: 2.0, subset_list[-1]: -1.0})
    session = engine.draft_proposer.open_session(prompt, params, seed=3, processing=processing)
    block = session.propose(3)
    subset = draft.vocab_subset
    assert len(block.token_ids) == 3 and all(t in subset.tolist() for t in block.token_ids.tolist())
    for j in range(3):
        ctx = prompt + block.token_ids.tolist()[:j]
        with torch.inference_mode():
            logits = full.model(torch.tensor([ctx])).logits[0, -1:].float()[:, subset]  # [1, 40]
        if processing is not None:
            logits = processing.apply(expand_logits(logits, subset, V), ctx)[:, subset]
        want = torch.zeros(V)
        want[subset] = warp_probs(logits, params)[0]
        got = torch.zeros(V)
        got[block.q_ids[j]] = block.q_probs[j]
        assert torch.allclose(got, want, atol=1e-5), j
        assert float(got[~torch.isin(torch.arange(V), subset)].sum()) == 0.0
        assert abs(float(got.sum()) - 1.0) < 1e-5


def test_sampled_output_follows_the_target_distribution(folders, target, n=700):
    """Chi-square over every path of two tokens (tests/test_engine.py's pattern). The subset
    holds the target's most likely first token but not the other two of its top 3, so the draft
    is often rejected (and the target's correction lies outside the subset) and sometimes accepted."""
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = [60, 61, 62]
    with torch.inference_mode():
        p0 = warp_probs(target.model(torch.tensor([prompt])).logits[0, -1:].float(), params)[0]
        firsts = p0.nonzero().flatten().tolist()
        cells, probs = [], []
        for a in firsts:
            p1 = warp_probs(target.model(torch.tensor([prompt + [a]])).logits[0, -1:].float(), params)[0]
            for b in p1.nonzero().flatten().tolist():
                cells.append((a, b))
                probs.append(float(p0[a]) * float(p1[b]))
    top = int(p0.argmax())
    others = [i for i in firsts if i != top]
    ranking = [top] + [i for i in shuffled(9) if i not in firsts]
    draft = load_draft(folders, 24, ranked_table(build_tiny_tokenizer(), ranking))
    subset = set(draft.vocab_subset.tolist())
    assert top in subset and not subset & set(others)
    engine = SpeculativeEngine(target, draft)
    counts = {c: 0 for c in cells}
    proposed = accepted = 0
    for seed in range(n):
        res = engine.generate(GenerationRequest(
            prompt_token_ids=prompt, max_tokens=2, ignore_eos=True,
            sampling={"temperature": 1.0, "top_k": 3, "seed": seed}, speculation={"proposer": "draft", "k": 1}))
        proposed += res.stats.proposed
        accepted += res.stats.accepted
        key = tuple(res.token_ids)
        assert key in counts, key
        counts[key] += 1
    assert proposed >= n and 0 < accepted < proposed  # both the accept and the reject paths ran
    assert sum(counts[c] for c in cells if c[0] in others) > 0.1 * n  # first tokens outside the subset
    observed = [counts[c] for c in cells]
    expected = [p * n / sum(probs) for p in probs]
    res = chisquare(observed, expected)
    assert res.pvalue > 1e-3, (observed, expected)


def test_propose_batch_equals_propose_alone(folders, target):
    draft = load_draft(folders, 32, ranked_table(build_tiny_tokenizer(), shuffled(4)))
    proposer = SpeculativeEngine(target, draft).draft_proposer
    specs = [(1, 4, 0.0), (20, 8, 1.0), (7, 3, 0.7), (12, 0, 0.0)]

    def sessions():
        return [proposer.open_session([3 + (i * 7 + n) % 300 for i in range(n)],
                                      SamplingParams(temperature=t, top_k=20), seed=n) for n, _, t in specs]

    a, b = sessions(), sessions()
    for _ in range(3):
        ks = [k for _, k, _ in specs]
        ref = [s.propose(k) for s, k in zip(a, ks)]
        got = proposer.propose_batch(b, ks)
        for r, g in zip(ref, got):
            assert r.token_ids.tolist() == g.token_ids.tolist()
            assert set(r.token_ids.tolist()) <= set(draft.vocab_subset.tolist())
            if r.q_ids is not None:
                assert torch.equal(r.q_ids, g.q_ids) and torch.allclose(r.q_probs, g.q_probs, atol=1e-5)
        for s1, s2, r in zip(a, b, ref):  # a first draft, then a target token outside the subset
            outside = next(i for i in range(3, V) if i not in set(draft.vocab_subset.tolist()))
            s1.commit(r.token_ids.tolist()[:1] + [outside])
            s2.commit(r.token_ids.tolist()[:1] + [outside])


# --- the served draft replica and the command line ----------------------------------------------


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocabtable") / "tiny.json.gz"
    ranked_table(build_tiny_tokenizer(), shuffled(6)).save(path)
    return path


@pytest.mark.parametrize("sampling", [None, {"temperature": 0.9, "top_k": 40, "seed": 77}], ids=["greedy", "sampled"])
def test_served_draft_replica_uses_the_subset(folders, target, table_file, sampling):
    """deployments/draft.py loads the draft with AppConfig.draft_vocab_subset and drafts through
    the same proposer (DraftCombiner -> propose_batch): the served output equals the in-process
    engine's with the same subset draft, and greedy equals the target alone."""
    import asyncio

    from deployments import convert
    from deployments.config import AppConfig
    from deployments.draft import Draft
    from protos.specdec.v1 import specdec_pb2 as pb
    from tests.deployments.test_draft import PROMPT, Wire, _collect, _job

    wire = Wire(target)
    cfg = AppConfig(target_model=str(folders[0]), draft_model=str(folders[1]), cpu_threads=1,
                    draft_vocab_subset=32, draft_vocab_table=str(table_file))
    rep = Draft(cfg, send_factory=lambda key: wire.send)
    draft = rep.draft_proposer.draft
    assert len(draft.vocab_subset) == 32 and draft.model.get_output_embeddings().out_features == 32
    kw = dict(max_tokens=30, ignore_eos=True, speculation=pb.SpeculationHints(proposer=pb.PROPOSER_DRAFT, max_k=4))
    if sampling is not None:
        kw["sampling"] = pb.SamplingParams(**sampling)
    job = _job(PROMPT, **kw)
    got = convert.join_chunks(asyncio.run(_collect(rep.Generate(job.SerializeToString()))))
    expected = SpeculativeEngine(target, draft).generate(convert.request_from_proto(job.request))
    assert list(got.token_ids) == expected.token_ids and got.stats.accepted == expected.stats.accepted
    if sampling is None:
        assert expected.token_ids == target_greedy(target, PROMPT, 30)


def test_app_config_validates_the_subset():
    from pydantic import ValidationError

    from deployments.config import AppConfig

    with pytest.raises(ValidationError, match="draft_vocab_subset"):
        AppConfig(draft_vocab_subset=0)
    assert AppConfig(draft_vocab_subset=32768).draft_vocab_subset == 32768


def test_serve_flags_override_the_config():
    import argparse

    from deployments import cli

    p = argparse.ArgumentParser()
    cli.add_serve_arguments(p)
    cfg = cli.load_config(p.parse_args(["--draft-vocab-subset", "16384", "--draft-vocab-table", "t.json.gz"]))
    assert (cfg.draft_vocab_subset, cfg.draft_vocab_table) == (16384, "t.json.gz")
    assert cli.load_config(p.parse_args(["--draft-vocab-subset", "0"])).draft_vocab_subset is None


def test_generate_command_with_a_subset(folders, target, table_file, capsys):
    import json

    from specdec import cli

    rc = cli.main(["generate", "--target", str(folders[0]), "--draft", str(folders[1]), "--draft-vocab-subset", "48",
                   "--draft-vocab-table", str(table_file), "--max-tokens", "12", "-k", "3", "--json", "x"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    prompt = target.tokenizer.encode("x")
    assert out["token_ids"] == target_greedy(target, prompt, 12)
    assert cli.main(["generate", "--target", str(folders[0]), "--draft", str(folders[1]), "--draft-vocab-subset", "0",
                     "--draft-vocab-table", str(table_file), "x"]) == 2
    assert "draft vocabulary subset must be an integer from 1 to 320" in capsys.readouterr().err


@pytest.mark.demo
def test_shipped_table_fits_the_demo_pair(demo_pair_folders):
    """The shipped table belongs to the demo pair's tokenizer (draft and target share it), and
    its subsets keep the EOS ids and the Markdown code fence a chat answer opens with."""
    from transformers import AutoTokenizer

    table = FrequencyTable.load()
    for role in ("draft", "target"):
        table.check_tokenizer(AutoTokenizer.from_pretrained(demo_pair_folders[role]), role)
    tok = AutoTokenizer.from_pretrained(demo_pair_folders["draft"])
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    ids = subset_ids(table, tok, 16384, min(len(tok), 151936), always=eos).tolist()
    assert len(ids) == 16384 and set(eos) <= set(ids)
    assert tok.convert_tokens_to_ids("```") in ids and tok.convert_tokens_to_ids("Ġreturn") in ids


def test_bench_with_a_subset_draft(table_file, tmp_path):
    """``specdec bench --draft-vocab-subset``: our draft rows run with the subset draft and stay
    identical to the target alone; transformers' assisted generation runs in the same run with the
    full-vocabulary draft (loaded beside it)."""
    import argparse

    from benchmarks.inprocess import add_bench_arguments, run_bench

    root = tmp_path / "pair"
    target = build_tiny_model(root / "target", seed=0, max_positions=1024)
    from transformers import Qwen2ForCausalLM

    draft = build_tiny_model(root / "draft", seed=1, base=Qwen2ForCausalLM.from_pretrained(target), noise=0.03,
                             max_positions=1024)
    argv = ["--quick", "--threads", "1", "--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "o"),
            "--draft-vocab-subset", "64", "--draft-vocab-table", str(table_file), "--proposers", "draft",
            "--prompts", "code-prime", "--ks", "2"]
    parser = add_bench_arguments(argparse.ArgumentParser())
    report = run_bench(parser.parse_args(argv + ["--hf", "assisted"]))
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"target", "hf-assisted", "ours-draft-K2"} and report["meta"]["draft_vocab_subset"] == 64
    assert report["meta"]["hf_assisted_draft"] == "the full-vocabulary draft, loaded beside the subset draft"
    assert rows["ours-draft-K2"]["identical"] is True and rows["ours-draft-K2"]["proposed"] >= 1
    assert rows["hf-assisted"]["identical"] is True and rows["hf-assisted"]["proposed"] >= 1
    report = run_bench(parser.parse_args(argv + ["--skip-hf"]))
    assert {r["method"] for r in report["rows"]} == {"target", "ours-draft-K2"}
