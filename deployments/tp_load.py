"""Loading one TP rank's shard of the target: local linears, quantization, fused projections.

:func:`load_tp_model` loads an HF folder as TP shard ``rank`` of ``tp_size`` (a plain load at
TP=1), quantizes it through the cache (:mod:`specdec.models.quant_cache`), fuses q/k/v and
gate/up into one matmul each in int4/w8a8 (:mod:`specdec.models.fused`, at TP=1 as the
in-process :func:`specdec.models.loader.load_model` does; at TP > 1 the column-sharded local
layers, :func:`fuse_tp_projections`) and makes the forward shape-invariant. The TP worker
actor that holds the result is :class:`deployments.tp_worker.TPWorker`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


class TPLocalLinear(torch.nn.Module):
    """One rank's part of a tensor-parallel linear layer, computed on plain local tensors.

    transformers' TP keeps the weights as DTensors and wraps each layer's ``forward``; quantized
    and shape-invariant layers need plain local weights instead (torchao quantizes a tensor, the
    invariant forward replaces ``forward``). This module holds the rank's local layer (``inner``:
    an ``nn.Linear`` on the local shard, later quantized or made invariant in place) and does the
    layer's communication around it, as transformers' styles do:

    - ``colwise``: weight rows (output features) sharded; the output stays this rank's shard.
    - ``colwise_gather_output``: the same, then the shards are gathered along the last dim on every
      rank (the LM head: every rank ends with the full logits).
    - ``rowwise``: weight columns (input features) sharded, input sharded; the partial products
      are summed over the ranks (``all_reduce``), then the (replicated) bias is added once.

    Args:
        inner: the local ``nn.Linear``: weight ``[out_local, in_local]``.
        style: one of the three above.
        group: the TP process group (None: the default group).
        out_sizes: for ``colwise_gather_output``, every rank's local output width, rank order.
        bias: for ``rowwise``, the full bias ``[out]`` (or None); ``inner`` then has none.
    """

    STYLES = ("colwise", "colwise_gather_output", "rowwise")

    def __init__(self, inner: torch.nn.Module, style: str, group=None, out_sizes: list[int] | None = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if style not in self.STYLES:
            raise ValueError(f"unsupported TP style {style!r} for a local linear; expected one of {self.STYLES}")
        self.inner, self.style, self.group = inner, style, group
        self.out_sizes = list(out_sizes or [])
        self.bias = torch.nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        y = self.inner(x)
        if self.style == "rowwise":
            dist.all_reduce(y, group=self.group)
            return y + self.bias if self.bias is not None else y
        if self.style == "colwise_gather_output":
            width = max(self.out_sizes)
            pad = width - y.shape[-1]
            y_pad = torch.nn.functional.pad(y, (0, pad)).contiguous() if pad else y.contiguous()
            parts = [torch.empty_like(y_pad) for _ in self.out_sizes]
            dist.all_gather(parts, y_pad, group=self.group)
            return torch.cat([p[..., :n] for p, n in zip(parts, self.out_sizes)], dim=-1)
        return y

    def extra_repr(self) -> str:
        return f"style={self.style}"


def localize_tp_linears(model: torch.nn.Module) -> int:
    """Replace every TP-sharded ``nn.Linear`` of ``model`` (DTensor weights, transformers'
    wrapped ``forward``) by a :class:`TPLocalLinear` around a plain local ``nn.Linear``.

    The local layer's ``in_features``/``out_features`` are the shard's (so int4 groups are
    chosen to divide the *local* input width). Layers that are not sharded stay as they are.

    Returns:
        the number of layers replaced.

    Raises:
        ValueError: a sharded layer whose TP style is not colwise, colwise_gather_output or rowwise.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    mesh = getattr(model, "_device_mesh", None)
    group = None
    if mesh is not None:
        group = mesh.get_group("tp") if mesh.ndim > 1 else mesh.get_group()
    world = dist.get_world_size(group)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, torch.nn.Linear) and isinstance(child.weight, DTensor)):
                continue
            fqn = next(n for n, m in model.named_modules() if m is child)
            style = plan.get(fqn) or plan.get(replace_layer_number_by_wildcard(fqn))
            if style not in TPLocalLinear.STYLES:
                raise ValueError(f"TP layer {fqn} has style {style!r}; only {TPLocalLinear.STYLES} can be "
                                 "quantized or made shape-invariant")
            weight = child.weight.to_local().detach()
            bias = child.bias
            bias = bias.to_local().detach() if isinstance(bias, DTensor) else (bias.detach() if bias is not None else None)
            child.__dict__.pop("forward", None)  # drop transformers' TP wrapper: plain nn.Linear.forward
            child._parameters["weight"] = torch.nn.Parameter(weight, requires_grad=False)
            child._parameters["bias"] = None if style == "rowwise" or bias is None else torch.nn.Parameter(bias, requires_grad=False)
            child.out_features, child.in_features = weight.shape
            out_sizes = None
            if style == "colwise_gather_output":
                sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
                dist.all_gather(sizes, torch.tensor([weight.shape[0]]), group=group)
                out_sizes = [int(t) for t in sizes]
            setattr(parent, name, TPLocalLinear(child, style, group, out_sizes, bias if style == "rowwise" else None))
            replaced += 1
    return replaced


def fuse_tp_projections(model: torch.nn.Module) -> int:
    """Fuse each layer's q/k/v and gate/up local shards at TP > 1 (int4, w8a8 or w7a8), in place.

    q/k/v and gate/up are column-sharded (``colwise``: each rank holds some output rows, no
    communication), so a rank's local layers of one group multiply the same local input and fuse
    like unsharded ones: each :class:`TPLocalLinear`'s ``inner`` becomes a
    :class:`~specdec.models.fused.FusedSlice` of one fused local layer, its communication (none
    for colwise) unchanged. A group whose layers are not all ``colwise`` TPLocalLinears, or that
    :func:`specdec.models.fused.fuse_projections` refuses (not int4/w8a8, not bitwise on its
    probe), stays unfused (one log line per reason).

    Returns:
        the number of groups fused.
    """
    from specdec.models.fused import GROUPS, FusedSlice, fuse_projections

    fused = 0
    skipped: dict[str, int] = {}
    for module in list(model.modules()):
        for names in GROUPS:
            parts = [getattr(module, n, None) for n in names]
            if any(p is None for p in parts):
                continue
            if not all(isinstance(p, TPLocalLinear) and p.style == "colwise" and p.bias is None for p in parts):
                why = "not all column-sharded local layers"
                skipped[why] = skipped.get(why, 0) + 1
                continue
            if any(isinstance(p.inner, FusedSlice) for p in parts):
                continue
            holder = torch.nn.Module()
            for n, p in zip(names, parts):
                setattr(holder, n, p.inner)
            if fuse_projections(holder):
                for n, p in zip(names, parts):
                    p.inner = getattr(holder, n)
                fused += 1
    if skipped:
        log.info("TP projections left unfused: %s", skipped)
    return fused


def load_tp_model(path: str, rank: int, tp_size: int, dtype: str | torch.dtype = "float32",
                  device: torch.device | str = "cpu", invariant: bool | None = None, fuse: bool = True):
    """Load an HF-folder causal LM as TP shard ``rank`` of ``tp_size`` (plain load when 1).

    ``torch.distributed`` must already be initialised when ``tp_size > 1``; transformers then
    places each shard on the accelerator ``LOCAL_RANK`` names (cuda:0 under Ray) or the CPU.
    At ``tp_size == 1`` the model is moved to ``device`` explicitly (a TP=1 worker holding a GPU
    computes on it).

    int8/int4/w8a8 and the shape-invariant forward at ``tp_size > 1``: transformers loads the bfloat16
    shard (DTensor weights); :func:`localize_tp_linears` turns each sharded linear into plain local
    tensors with the communication around them, then each rank quantizes its own shard (int4
    groups divide the local input width) and the local layers are made invariant. float32 at
    TP > 1 keeps transformers' own TP forward.

    Args:
        dtype: the weight format (:mod:`specdec.models.formats`; a torch float dtype is accepted
            too).
        invariant: make the forward shape-invariant (:mod:`specdec.engine.invariant`); None: for
            every format but float32 (see :func:`specdec.models.loader.load_model`). Invariance
            holds per TP degree: TP=2 sums two partial products per row, so its rows may differ
            in the last bits from TP=1's.
        fuse: int4, w8a8 or w7a8: fuse q/k/v and gate/up into one matmul each, as
            :func:`specdec.models.loader.load_model` does (bitwise the same outputs, checked per
            group at load: :func:`specdec.models.fused.fuse_projections`); at TP > 1 the local
            column shards (:func:`fuse_tp_projections`).

    Returns:
        a :class:`specdec.models.loaded.LoadedModel` whose ``model`` returns full logits and whose
        ``tokenizer`` is only its :class:`~specdec.models.loaded.TokenizerFacts` (a rank never
        encodes or decodes text);
        ``quant_cache`` says whether int8/int4/w8a8 weights came from the cache (each rank caches its
        own shard next to the folder: :mod:`specdec.models.quant_cache`).

    Raises:
        ValueError: an unknown format, or a TP style that cannot be localized.
    """
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models import formats, quant_cache
    from specdec.models.loaded import LoadedModel, TokenizerFacts

    fmt = formats.check_format(str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype)
    if invariant is None:
        invariant = fmt != "float32"
    # a rank only scores ids: it keeps the tokenizer's length and EOS id, not the tokenizer (~150 MiB;
    # read first, so the heap it frees is reused by the weights)
    tokenizer = TokenizerFacts.of(AutoTokenizer.from_pretrained(path))
    kwargs: dict[str, Any] = {"dtype": formats.compute_dtype(fmt)}
    if tp_size > 1:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=tp_size)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    if tp_size == 1:
        model = model.to(device)
    elif fmt in formats.QUANTIZED_FORMATS or invariant:
        localize_tp_linears(model)
    status = quant_cache.quantize_cached(model, fmt, Path(path), rank=rank, tp_size=tp_size)
    if fuse and fmt in formats.FUSED_FORMATS:
        from specdec.models.fused import fuse_projections

        fuse_projections(model) if tp_size == 1 else fuse_tp_projections(model)
    if invariant:
        from specdec.engine.invariant import make_invariant

        make_invariant(model)
    if fmt in formats.QUANTIZED_FORMATS:
        from specdec.models.release import release_after_load

        release_after_load(model)  # w8a8 prepacked now; file pages no tensor uses dropped
    cfg = model.config
    return LoadedModel(
        name=f"{path} (TP rank {rank}/{tp_size})",
        model=model,
        tokenizer=tokenizer,
        max_positions=int(cfg.max_position_embeddings),
        vocab_rows=int(cfg.vocab_size),
        weight_format=fmt,
        invariant=invariant,
        quant_cache=status,
    )
