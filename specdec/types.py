"""Plain data exchanged between proposer, verifier and decoding loop.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

- p: the target's next-token distribution; q: the proposer's (draft's) distribution.
- A speculation step drafts K tokens (a *candidate block*), the target scores the K drafts
  plus one more position in one forward pass, the verifier accepts the longest agreeing
  prefix (n tokens, the *accepted count*), and emits one more token from the target: the
  *bonus token* if all K were accepted, else the *correction* sampled where the first draft
  was rejected. A step therefore emits n + 1 tokens (its *accepted length*).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a tensor is made: the serving layer's router and target
    import torch  # replicas use these types and hold no model (tests/deployments/test_lean_imports.py)


@dataclass(frozen=True)
class DraftBlock:
    """A candidate block of K proposed tokens and the proposal distribution they came from.

    The proposal distribution q is sent *sparsely*: the proposer samples from a distribution
    whose support is at most M tokens per position (``q_ids``) with probabilities ``q_probs``.
    Rejection sampling is exact for any proposal distribution as long as the verifier uses the
    one the proposer sampled from, so a draft that restricts its own distribution to its top-M
    tokens keeps the output distributed exactly as the target's (Leviathan et al. 2023, §2.3).

    Attributes:
        token_ids: ``[K]`` int64, the proposed tokens; K may be 0 (nothing to propose).
        q_ids: ``[K, M]`` int64 or None; support of q at each position. None means a
            deterministic proposal (q is one-hot at ``token_ids``), as for greedy drafting and
            prompt lookup.
        q_probs: ``[K, M]`` float32 or None; q over ``q_ids`` (rows sum to 1; padding entries
            carry probability 0).

    Proposers build blocks on the CPU (a block is what goes on the wire); the verifier moves
    them to the target's device.
    """

    token_ids: torch.Tensor
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None

    def __post_init__(self):
        if self.token_ids.dim() != 1:
            raise ValueError(f"token_ids must be [K], got shape {tuple(self.token_ids.shape)}")
        if (self.q_ids is None) != (self.q_probs is None):
            raise ValueError("q_ids and q_probs must be given together")
        if self.q_ids is not None:
            k = self.token_ids.shape[0]
            if self.q_ids.dim() != 2 or self.q_ids.shape[0] != k or self.q_ids.shape != self.q_probs.shape:
                raise ValueError(
                    f"q_ids/q_probs must be [K={k}, M], got {tuple(self.q_ids.shape)} and "
                    f"{tuple(self.q_probs.shape)}"
                )

    @property
    def k(self) -> int:
        """Number of proposed tokens K."""
        return int(self.token_ids.shape[0])

    @classmethod
    def empty(cls) -> "DraftBlock":
        """The block that proposes nothing (K = 0): the step is plain decoding."""
        import torch

        return cls(token_ids=torch.empty(0, dtype=torch.long, device="cpu"))

    def __repr__(self) -> str:
        m = None if self.q_ids is None else int(self.q_ids.shape[1])
        return f"DraftBlock(K={self.k}, M={m}, token_ids={self.token_ids.tolist()})"


@dataclass(frozen=True)
class BatchShape:
    """The target forward that verified a block: a batched one (continuous batching) or, on the
    unbatched path, the block's own (one row).

    Attributes:
        forward: the target replica's counter of forwards (identifies the forward).
        rows: sessions the forward fed (prefill chunks included; 1 unbatched).
        positions: positions it fed (Σ (K_i + 1) plus prefill chunks, uncached prompts included).
        seconds: its duration, wall seconds (scoring and deciding every row).
        context: mean tokens in the target's KV cache per row it fed, before it (None: unknown).
    """

    forward: int
    rows: int
    positions: int
    seconds: float
    context: float | None = None


@dataclass(frozen=True)
class VerifyResult:
    """What the verifier decided for one candidate block.

    Attributes:
        accepted: n, the number of draft tokens accepted (0..K).
        token_ids: the n + 1 tokens emitted by this step (accepted drafts, then the bonus or
            correction token).
        logprobs: the target's log-probability (natural log, of the unmodified distribution,
            temperature 1) of each emitted token, or None when not requested.
        committed_len: total sequence length (prompt + generated, in tokens) after this step.
            Both caches keep at most ``committed_len - 1`` positions: the last emitted token has
            not been fed to either model yet.
        top_logprobs: per emitted token, the target's N most likely ``(id, logprob)`` pairs
            (same distribution as ``logprobs``, most likely first), or None when not requested.
        batch: the batched forward that verified the block, when the target reports it.
    """

    accepted: int
    token_ids: list[int]
    logprobs: list[float] | None
    committed_len: int
    top_logprobs: list[list[tuple[int, float]]] | None = None
    batch: BatchShape | None = None


class FinishReason(str, enum.Enum):
    """Why a generation ended. The first condition to fire, token by token, wins."""

    EOS = "eos"  #: the model's end-of-sequence token
    STOP_TOKEN = "stop_token"  #: one of the request's stop token ids
    STOP_STRING = "stop_string"  #: one of the request's stop strings completed
    MAX_TOKENS = "max_tokens"  #: the request's max_tokens was reached
    CONTEXT_LENGTH = "context_length"  #: the model's context limit was reached
    CANCELLED = "cancelled"  #: the caller cancelled


@dataclass
class Usage:
    """Token counts of one request: completion_tokens equals len(token_ids) returned."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class SpeculationStats:
    """Speculation counters of one request (pooled counts; ratios derived from them).

    Attributes:
        steps: speculation steps (target forward passes), including K = 0 steps.
        proposed: draft tokens proposed, summed over steps.
        accepted: draft tokens accepted, summed over steps.
        rejected_steps: steps in which a draft token was rejected (accepted < K).
        accepted_per_position: ``[j]`` = how many times the draft token at position j (0-based)
            was accepted; its length is the largest K used.
        proposed_per_position: ``[j]`` = how many times a draft token was proposed at position j.
        k_counts: K -> number of steps run with that K.
        draft_time_s: wall seconds spent proposing.
        verify_time_s: wall seconds spent in target scoring and verification.
    """

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    rejected_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    k_counts: dict[int, int] = field(default_factory=dict)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def record_step(self, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """Count one speculation step that proposed ``k`` tokens and accepted ``accepted``."""
        if not 0 <= accepted <= k:
            raise ValueError(f"accepted={accepted} outside 0..K={k}")
        self.steps += 1
        self.proposed += k
        self.accepted += accepted
        if accepted < k:
            self.rejected_steps += 1
        while len(self.proposed_per_position) < k:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(k):
            self.proposed_per_position[j] += 1
        for j in range(accepted):
            self.accepted_per_position[j] += 1
        self.k_counts[k] = self.k_counts.get(k, 0) + 1
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens, or None when nothing was proposed."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per step, 1 + accepted / steps (vLLM's "acceptance length"), or None."""
        return 1.0 + self.accepted / self.steps if self.steps else None

    def as_dict(self) -> dict:
        """JSON-ready view, derived ratios included."""
        return {
            "steps": self.steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "rejected_steps": self.rejected_steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_per_position": list(self.accepted_per_position),
            "proposed_per_position": list(self.proposed_per_position),
            "k_counts": {int(k): v for k, v in sorted(self.k_counts.items())},
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
        }


@dataclass
class GenerationChunk:
    """One streamed piece of a generation; concatenating chunks gives the unary result.

    Attributes:
        text: new text, never containing (part of) a stop string that fired.
        token_ids: new token ids, cut at the same boundary as the text.
        logprobs: target log-probabilities of ``token_ids``, or None if not requested.
        finish_reason: set on the last chunk only.
        top_logprobs: per token of ``token_ids``, the target's N most likely ``(id, logprob)``
            pairs, or None if not requested.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class GenerationResult:
    """A finished generation: the concatenation of its chunks plus usage and statistics."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    stats: SpeculationStats
    logprobs: list[float] | None = None
    elapsed_s: float = 0.0
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def as_dict(self) -> dict:
        """Plain data (the JSON that ``specdec generate --json`` and ``specdec client --json`` print)."""
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason.value,
            "usage": {"prompt_tokens": self.usage.prompt_tokens, "completion_tokens": self.usage.completion_tokens},
            "stats": self.stats.as_dict(),
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "elapsed_s": self.elapsed_s,
        }


@dataclass(frozen=True)
class Checkpoint:
    """A generation between two speculation steps: what continues it elsewhere exactly.

    Every step draws its randomness from streams keyed by (seed, the committed length the step
    starts from) (:func:`specdec.engine.sampling.step_generator`), and a sampled step's output
    depends on where its block starts. So a generation resumed from a checkpoint, which is
    always taken at the end of a step, continues token for token as the uninterrupted one (same
    request, seed and K schedule); resumed from a point inside a step's emitted tokens, it
    would start a block where the uninterrupted run never did and diverge under sampling.

    Attributes:
        token_ids: every completion token committed so far, in order (the target's committed
            sequence is the prompt followed by these).
        logprobs: their target log-probabilities, or None when not requested.
        top_logprobs: per token its N most likely ``(id, logprob)`` pairs, or None.
        steps: speculation steps run so far (a K schedule that counts steps continues from it).
        seed: the request's seed (the draft's and the target's streams derive from it).
        sent_ids: how many of ``token_ids`` have been streamed (the rest was held back: a
            partial UTF-8 character or text that may become a stop string).
        sent_text_chars: characters of text streamed so far.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    steps: int = 0
    seed: int = 0
    sent_ids: int = 0
    sent_text_chars: int = 0

    @property
    def held_ids(self) -> list[int]:
        """The committed tokens not streamed yet."""
        return self.token_ids[self.sent_ids:]
