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
    family: str  # target | hf-assisted | hf-prompt-lookup | ours | ours-adaptive
    proposer: str | None = None  # draft | ngram | none (ours only)
    k: int | None = None
    min_confidence: float = 0.0  # draft proposer: early stop below this draft probability
    warm: int | None = None  # ours-adaptive: earlier requests of the prompt's type that taught its controller


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
    ttft_s: float | None = None  # ours: seconds to the first token (both prefills and the first step)
    repeat: int | None = None  # the bench's repeat (round) this run belongs to
    decision: dict | None = None  # ours-adaptive: the controller's decision (k, reason, alpha, probe)
    k_counts: dict | None = None  # ours: steps per K


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
        self._adaptive = None  # benchmarks.inprocess_adaptive.AdaptiveState, on first use
        self.tenant: str = "code"  # ours-adaptive: the tenant of the next runs (the prompt's type)

    @property
    def adaptive(self):
        """The learned controllers of the ``ours-adaptive-w<N>`` methods."""
        if self._adaptive is None:
            from benchmarks.inprocess_adaptive import AdaptiveState
            from specdec.request import GenerationRequest

            self._adaptive = AdaptiveState(self.engine, lambda text: self.engine.encode(GenerationRequest(
                messages=[{"role": "user", "content": text}], max_tokens=1)))
        return self._adaptive

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
        if method.family == "ours-adaptive":
            return self._run_adaptive(method, prompt_ids, tokens)
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
        from specdec.control.adaptive import run_timed

        req = GenerationRequest(prompt_token_ids=list(prompt_ids), max_tokens=tokens, speculation=spec)
        tm: dict = {}
        with _timer(tm):
            timed = run_timed(self.engine.start(req))
        return _ours_outcome(timed, tm)

    def _run_adaptive(self, method: Method, prompt_ids: list[int], tokens: int) -> RunOutcome:
        from benchmarks.inprocess_adaptive import record, run_adaptive

        ctl = self.adaptive.controller(method.warm or 0, self.tenant, self.args.tokens, method.min_confidence)
        tm: dict = {}
        with _timer(tm):
            timed, decision = run_adaptive(self.engine, ctl, self.tenant, prompt_ids, tokens, method.min_confidence)
        record(ctl, self.tenant, timed)
        out = _ours_outcome(timed, tm)
        out.decision = {"k": decision.k, "reason": decision.reason, "alpha": decision.alpha,
                        "probe": decision.probe, "predicted_speedup": decision.predicted_speedup}
        return out


def _ours_outcome(timed, tm: dict) -> RunOutcome:
    s = timed.result.stats
    return RunOutcome(token_ids=list(timed.result.token_ids), **tm, proposed=s.proposed, accepted=s.accepted,
                      steps=s.steps, draft_time_s=s.draft_time_s, verify_time_s=s.verify_time_s,
                      ttft_s=timed.ttft_s, k_counts={int(a): b for a, b in s.k_counts.items()})


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
    if have_draft:
        c = getattr(args, "adaptive_min_confidence", 0.0)
        tag = f"-c{c:g}" if c > 0 else ""
        out += [Method(f"ours-adaptive-w{w}{tag}", "ours-adaptive", "draft", None, c, w)
                for w in getattr(args, "adaptive", None) or []]
    return out


def methods_for(methods: list[Method], prompt: dict, only: dict[str, list[str]]) -> list[Method]:
    """The methods run on ``prompt``: all, or with ``--only`` naming its name or type, the target
    alone and the labels listed (a prompt's name wins over its type).

    Raises:
        ValueError: a listed label that is not a method of this run.
    """
    labels = only.get(prompt["name"], only.get(prompt["type"]))
    if labels is None:
        return list(methods)
    known = {m.label for m in methods}
    unknown = [lab for lab in labels if lab not in known]
    if unknown:
        raise ValueError(f"--only {prompt['name']}/{prompt['type']}: unknown method(s) {unknown}; this run has "
                         f"{sorted(known)}")
    return [m for m in methods if m.family == "target" or m.label in labels]


def warm_up(runner: Runner, methods: list[Method], prompt_ids: list[int], tokens: int) -> None:
    """One untimed call of every method at the full length ``tokens`` on the first prompt, so no
    method's timed runs carry first-call costs (the process's first long generation, lazily grown
    allocations) that another method's do not: session 9's first timed target-alone run of
    32 tokens, after an 8-token warm-up, took 4.89 CPU-s against 3.44 for the same call later.
    An adaptive method warms with a throwaway cold controller (its learned state is unchanged)."""
    t0 = time.perf_counter()
    for m in methods:
        if m.family == "ours-adaptive":
            m = Method(m.label, m.family, m.proposer, m.k, m.min_confidence, 0)
        runner.run(m, prompt_ids, tokens)
    log(f"bench: warm-up ({len(methods)} calls of {tokens} tokens) took {time.perf_counter() - t0:.1f} s")
