"""What ``specdec bench`` (:mod:`benchmarks.inprocess`) times: the methods (target alone,
transformers' assisted generation and prompt lookup, ours per proposer and K), one timed call of
each (wall and process CPU seconds), the step counts transformers' generators report, and the
untimed warm-up."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from dataclasses import dataclass, field

import torch

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Method:
    """One thing to time on a prompt."""

    label: str
    family: str  # target | hf-assisted | hf-prompt-lookup | ours
    proposer: str | None = None  # draft | ngram | none (ours only)
    k: int | None = None
    min_confidence: float = 0.0  # draft proposer: early stop below this draft probability


@dataclass
class RunOutcome:
    token_ids: list[int]
    seconds: float
    cpu_s: float = 0.0
    loadavg: float | None = None
    proposed: int | None = None
    accepted: int | None = None
    steps: int | None = None
    draft_time_s: float | None = None
    verify_time_s: float | None = None


@dataclass
class _HFRecorder:
    """Counts transformers' candidate/match numbers per assisted step (patched in for a call)."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    config: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.steps = self.proposed = self.accepted = 0
        self.config = {}


@contextlib.contextmanager
def _record_hf_steps(recorder: _HFRecorder):
    """Wrap ``update_candidate_strategy`` of transformers' candidate generators to count matches.

    transformers calls it once per assisted step with the target's logits over the candidates
    plus one (``scores [1, K+1, V]``) and the number of accepted candidates; the wrapper adds a
    few microseconds per step. It also records the settings the generator actually used.
    """
    from transformers.generation import candidate_generator as cg

    classes = [cg.AssistedCandidateGenerator, cg.PromptLookupCandidateGenerator]
    # prompt lookup inherits the method from CandidateGenerator: wrap the inherited one on the subclass
    originals = {c: c.update_candidate_strategy for c in classes}
    own = {c: "update_candidate_strategy" in c.__dict__ for c in classes}

    def wrap(orig):
        def update_candidate_strategy(self, input_ids, scores, num_matches):
            recorder.steps += 1
            recorder.proposed += int(scores.shape[1]) - 1
            recorder.accepted += int(num_matches)
            if not recorder.config:
                recorder.config = _generator_settings(self)
            return orig(self, input_ids, scores, num_matches)

        return update_candidate_strategy

    for c, orig in originals.items():
        setattr(c, "update_candidate_strategy", wrap(orig))
    try:
        yield recorder
    finally:
        for c, orig in originals.items():
            if own[c]:
                setattr(c, "update_candidate_strategy", orig)
            else:
                delattr(c, "update_candidate_strategy")


def _generator_settings(gen) -> dict:
    out: dict = {"candidate_generator": type(gen).__name__}
    if hasattr(gen, "num_output_tokens"):  # prompt lookup
        out["prompt_lookup_num_tokens"] = int(gen.num_output_tokens)
        out["max_matching_ngram_size"] = int(gen.max_matching_ngram_size)
    agc = getattr(gen, "assistant_generation_config", None)
    if agc is not None:
        out["num_assistant_tokens"] = int(gen.num_assistant_tokens)
        out["num_assistant_tokens_schedule"] = agc.num_assistant_tokens_schedule
        out["assistant_confidence_threshold"] = agc.assistant_confidence_threshold
        out["confidence_threshold_adapted"] = hasattr(gen, "probs")  # only with scikit-learn installed
    return out


@contextlib.contextmanager
def _timer(outcome_times: dict):
    """Wall (perf_counter) and process CPU seconds of the block, into ``outcome_times``."""
    gc.collect()
    outcome_times["loadavg"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        yield outcome_times
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # kernels queued by the call belong to it
        outcome_times["seconds"] = time.perf_counter() - t0
        outcome_times["cpu_s"] = time.process_time() - c0


class Runner:
    """Runs one method on one prompt (ids) for ``tokens`` new tokens and times the call."""

    def __init__(self, target, draft, args, assistant=None):
        from specdec.engine.engine import SpeculativeEngine

        self.target = target
        self.draft = draft
        self.assistant = assistant if assistant is not None else draft  # transformers' assisted generation
        self.args = args
        self.engine = SpeculativeEngine(target, draft)
        self.recorder = _HFRecorder()
        self.eos = target.eos_token_ids
        pad = target.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.eos[0]
        self.hf_config: dict[str, dict] = {}

    def _hf_kwargs(self, ids: torch.Tensor, tokens: int) -> dict:
        return dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )

    @torch.inference_mode()
    def run(self, method: Method, prompt_ids: list[int], tokens: int) -> RunOutcome:
        if method.family == "ours":
            return self._run_ours(method, prompt_ids, tokens)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        kwargs = self._hf_kwargs(ids, tokens)
        if method.family == "hf-assisted":
            kwargs["assistant_model"] = self.assistant.model
        elif method.family == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = self.args.hf_lookup_tokens
            kwargs["max_matching_ngram_size"] = self.args.hf_lookup_ngram
        self.recorder.reset()
        tm: dict = {}
        with _record_hf_steps(self.recorder), _timer(tm):
            out = self.target.model.generate(**kwargs)
        new = out[0, len(prompt_ids):].tolist()
        # batch size 1: generate stops at the first EOS; drop any padding after it defensively
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[: i + 1]
                break
        outcome = RunOutcome(token_ids=new, **tm)
        if method.family != "target":
            r = self.recorder
            outcome.steps, outcome.proposed, outcome.accepted = r.steps, r.proposed, r.accepted
            if r.config:
                self.hf_config[method.family] = dict(r.config)
        return outcome

    def _run_ours(self, method: Method, prompt_ids: list[int], tokens: int) -> RunOutcome:
        from specdec.request import GenerationRequest

        spec = {"proposer": method.proposer, "k": method.k or 0,
                "ngram_min": self.args.ngram_min, "ngram_max": self.args.ngram_max,
                "draft_min_confidence": method.min_confidence}
        req = GenerationRequest(prompt_token_ids=list(prompt_ids), max_tokens=tokens, speculation=spec)
        tm: dict = {}
        with _timer(tm):
            res = self.engine.generate(req)
        s = res.stats
        return RunOutcome(token_ids=list(res.token_ids), **tm, proposed=s.proposed, accepted=s.accepted,
                          steps=s.steps, draft_time_s=s.draft_time_s, verify_time_s=s.verify_time_s)


def bench_methods(args, have_draft: bool, have_assistant: bool | None = None) -> list[Method]:
    out = [Method("target", "target")]
    if not args.skip_hf:
        if (have_draft if have_assistant is None else have_assistant) and "assisted" in args.hf:
            out.append(Method("hf-assisted", "hf-assisted"))
        if "prompt-lookup" in args.hf:
            out.append(Method("hf-prompt-lookup", "hf-prompt-lookup"))
    if "none" in args.proposers:
        out.append(Method("ours-none", "ours", "none", 0))
    if "draft" in args.proposers and have_draft:
        for c in args.draft_min_confidence:
            tag = f"-c{c:g}" if c > 0 else ""
            out += [Method(f"ours-draft-K{k}{tag}", "ours", "draft", k, c) for k in args.ks]
    if "ngram" in args.proposers:
        out += [Method(f"ours-ngram-K{k}", "ours", "ngram", k) for k in args.ngram_ks]
    return out


def warm_up(runner: Runner, methods: list[Method], prompt_ids: list[int], a) -> None:
    """One short untimed call per method family (and per proposer), so first-call costs don't count."""
    n = min(a.tokens, 8)
    seen = set()
    t0 = time.perf_counter()
    for m in methods:
        key = (m.family, m.proposer)
        if key in seen:
            continue
        seen.add(key)
        warm = Method(m.label, m.family, m.proposer, min(m.k or 0, 2) if m.proposer != "none" else 0)
        runner.run(warm, prompt_ids, n)
    log(f"bench: warm-up ({len(seen)} calls of {n} tokens) took {time.perf_counter() - t0:.1f} s")
