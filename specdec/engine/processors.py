"""Logit processors that depend on the request and on the output so far, applied identically to
the target's p and the draft's q at every position of a block.

Speculative sampling is exact for the *processed* target distribution only if the proposal is
processed by the same rule at the same position (Leviathan et al. 2023, §2.3: any pair p, q).
A processor that looks at the output so far (penalties, ``min_tokens``) must see, at position i
of a block, the sequence that ends at i, including the drafted tokens before it: the target
scores K + 1 positions in one forward pass, so :meth:`LogitProcessing.apply` processes row i of a
``[N, V]`` logits matrix against the history cut at ``len(history) - N + 1 + i``; the draft, which
drafts one token at a time, applies it to one row after each drafted token.

Order and semantics follow transformers' ``generate`` (the tests use its processors as the
reference): ``logit_bias`` (``SequenceBiasLogitsProcessor`` with one-token sequences), then the
repetition penalty (``RepetitionPenaltyLogitsProcessor``: over prompt and output, a positive
logit divided by the penalty, a negative one multiplied), then OpenAI's presence and frequency
penalties (over the output only: ``logit -= frequency * count + presence * (count > 0)``;
transformers has no processor for them), then ``min_tokens`` (``MinNewTokensLengthLogitsProcessor``:
EOS and the stop token ids get -inf while fewer than ``min_tokens`` tokens were generated).
Warping (temperature, top-k, top-p, min-p) follows in :func:`specdec.engine.sampling.warp_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class LogitProcessing:
    """The output-dependent processing of one request.

    Attributes:
        prompt_len: prompt length in tokens (tokens after it are the output).
        logit_bias: token id -> additive bias (logits).
        repetition_penalty: > 0; 1 is off. Values below float32's smallest normal number act as
            it, and a penalized logit beyond float32's range saturates at its largest value.
        presence_penalty: subtracted once from the logit of every token in the output.
        frequency_penalty: subtracted per occurrence in the output.
        min_tokens: ``suppress_ids`` are masked while fewer output tokens than this exist.
        suppress_ids: ids masked before ``min_tokens`` (EOS and the request's stop token ids).
    """

    prompt_len: int
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    suppress_ids: tuple[int, ...] = ()

    @classmethod
    def for_request(cls, request, prompt_len: int, eos_ids: Sequence[int]) -> "LogitProcessing":
        """The processing of a :class:`specdec.request.GenerationRequest` whose prompt is
        ``prompt_len`` tokens; ``eos_ids`` of the target (not masked under ``ignore_eos``)."""
        s = request.sampling
        suppress = [] if request.ignore_eos else [int(t) for t in eos_ids]
        suppress += [int(t) for t in request.stop_token_ids if int(t) not in suppress]
        return cls(
            prompt_len=int(prompt_len),
            logit_bias={int(k): float(v) for k, v in (s.logit_bias or {}).items()},
            repetition_penalty=float(s.repetition_penalty),
            presence_penalty=float(s.presence_penalty),
            frequency_penalty=float(s.frequency_penalty),
            min_tokens=int(request.min_tokens),
            suppress_ids=tuple(sorted(suppress)) if request.min_tokens > 0 else (),
        )

    def options(self) -> dict:
        """``{"processing": self}`` when active, else ``{}``: the keyword options of a proposer's
        ``open_session`` (only options away from their default are passed, as
        :func:`specdec.engine.proposers.draft_model.draft_options` does)."""
        return {"processing": self} if self.active else {}

    @property
    def active(self) -> bool:
        """Whether :meth:`apply` changes anything at all."""
        return bool(
            self.logit_bias or self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
            or (self.min_tokens > 0 and self.suppress_ids)
        )

    def apply(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """Process ``N`` consecutive positions.

        Args:
            logits: ``[N, V]`` float; row i predicts the token after
                ``history[:len(history) - N + 1 + i]``.
            history: prompt + output so far, followed by the ``N - 1`` drafted tokens that rows
                1..N-1 condition on (int token ids).

        Returns:
            ``[N, V]`` float32 on the logits' device (a new tensor; ``logits`` is not changed).

        Raises:
            ValueError: ``history`` shorter than ``N - 1`` tokens or than the prompt.
        """
        n, vocab = int(logits.shape[0]), int(logits.shape[-1])
        base = len(history) - n + 1  # the prefix row 0 is conditioned on
        if base < self.prompt_len:
            raise ValueError(f"history of {len(history)} tokens is too short for {n} rows after a "
                             f"{self.prompt_len}-token prompt")
        out = logits.float().clone()
        if not self.active:
            return out
        dev = out.device
        if self.logit_bias:
            ids = torch.tensor([i for i in self.logit_bias if 0 <= i < vocab], dtype=torch.long, device=dev)
            bias = torch.tensor([self.logit_bias[int(i)] for i in ids.tolist()], dtype=torch.float32, device=dev)
            out[:, ids] += bias
        drafted = torch.tensor([int(t) for t in history[base:]], dtype=torch.long)  # [N-1]
        rows = torch.arange(n)
        if self.repetition_penalty != 1.0:
            seen = torch.zeros(n, vocab, dtype=torch.bool)
            prefix = torch.tensor([int(t) for t in history[:base]], dtype=torch.long)
            seen[:, prefix[prefix < vocab]] = True
            for j, t in enumerate(drafted.tolist()):  # row i sees drafts 0..i-1
                if t < vocab:
                    seen[j + 1:, t] = True
            seen = seen.to(dev)
            # A penalty below float32's smallest normal number acts as that number (1e-300 rounds
            # to 0 in float32: 0 / 0 = nan for a zero logit), and a positive logit divided past
            # float32's range saturates at its largest finite value instead of inf (inf - inf =
            # nan in the softmax): such tokens tie at the top, the distribution stays defined.
            pen = max(self.repetition_penalty, torch.finfo(torch.float32).tiny)
            out = torch.where(seen, torch.where(out < 0, out * pen, out / pen), out)
            out = out.clamp(max=torch.finfo(torch.float32).max)
        if self.presence_penalty or self.frequency_penalty:
            gen = torch.tensor([int(t) for t in history[self.prompt_len:base]], dtype=torch.long)
            counts = torch.zeros(n, vocab, dtype=torch.float32)
            gen = gen[gen < vocab]
            if gen.numel():
                counts += torch.bincount(gen, minlength=vocab)[:vocab].float()
            for j, t in enumerate(drafted.tolist()):
                if t < vocab:
                    counts[j + 1:, t] += 1.0
            counts = counts.to(dev)
            out = out - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).float()
        if self.min_tokens > 0 and self.suppress_ids:
            generated = base - self.prompt_len + rows  # [N] output tokens before each row
            early = (generated < self.min_tokens).to(dev)
            ids = torch.tensor([i for i in self.suppress_ids if 0 <= i < vocab], dtype=torch.long, device=dev)
            if early.any() and ids.numel():
                block = out[:, ids]
                out[:, ids] = torch.where(early[:, None], torch.full_like(block, float("-inf")), block)
        return out
