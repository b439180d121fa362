"""Load a model spec into a :class:`LoadedModel`, and a pair with its compatibility check.

Every kind ends in the same code path, ``from_pretrained(folder)`` on a Hugging Face folder:

- ``hf``: the folder itself;
- ``demo``: the folder :func:`specdec.models.demo.ensure_demo_folder` builds once per cache;
- ``gguf``: with ``cache_gguf=True`` (default) the folder converted once and cached under
  ``<cache>/gguf/<sha256>/`` (:func:`specdec.models.convert.cached_gguf_folder`); with
  ``cache_gguf=False`` transformers dequantizes the file on every load and nothing is written.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specdec.errors import ModelLoadError
from specdec.request import MAX_SPECULATION_LENGTH
from specdec.models import cache, convert, demo, formats, quant_cache
from specdec.models.loaded import LoadedModel
from specdec.models.spec import (
    DemoModelSpec,
    GGUFModelSpec,
    HFModelSpec,
    ModelPairSpec,
    ModelSpec,
    parse_model_spec,
)
from specdec.models.vocab import check_pair_compatible

log = logging.getLogger(__name__)


def load_model(
    spec: ModelSpec,
    *,
    weight_format: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    cache_gguf: bool = True,
    invariant: bool | None = None,
    attention: str | None = None,
    need_rows: int = MAX_SPECULATION_LENGTH + 1,
    vocab_subset: int | None = None,
    vocab_table: "FrequencyTable | str | Path | None" = None,
    fuse: bool = True,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> LoadedModel:
    """Load the model and tokenizer a spec names, in eval mode, on ``device``, in a weight format.

    Args:
        spec: what to load.
        weight_format: ``float32``, ``bfloat16``, ``float16``, ``int8``, ``int4``, ``w8a8`` or ``w7a8``
            (:mod:`specdec.models.formats`); None: the spec's ``format``, else
            ``$SPECDEC_WEIGHT_FORMAT``, else :func:`specdec.models.formats.default_format`.
        dtype: older spelling of a float format (``torch.bfloat16`` = ``"bfloat16"``); ignored
            when ``weight_format`` is given.
        device: torch device for the parameters.
        cache_gguf: for a GGUF spec, convert once and load the cached HF folder (see module doc).
        invariant: make the forward shape-invariant (:func:`specdec.engine.invariant.make_invariant`):
            what a target needs for exact speculation in reduced precision, and a draft for seeded
            sampled output that survives a session rebuilt from its history. None: on for every
            format but float32, where rows differ by about 1e-6 between block sizes (greedy
            flips are rare) and the invariant plan (fixed 8-row calls, MKL) would make plain
            decoding several times slower.
        attention: with ``invariant``, how attention computes rows: ``"auto"``, ``"probe"``,
            ``"sequence"`` or ``"row"`` (:func:`specdec.engine.invariant.choose_attention`); None:
            :data:`specdec.engine.invariant.SEQUENCE_ATTENTION`.
        need_rows: rows one forward must take unchunked (K_max + 1 positions).
        vocab_subset: a draft only: score only this many token ids, the most frequent ones
            (FR-Spec, :mod:`specdec.models.vocab_subset`): the output layer is sliced to those rows
            before quantizing, and :attr:`LoadedModel.vocab_subset` holds them. None: all.
        vocab_table: the frequency table (a :class:`~specdec.models.vocab_subset.FrequencyTable`
            or a file); None: the one shipped in the package.
        fuse: int4, w8a8 or w7a8 on a CPU: fuse each layer's q/k/v and gate/up projections into one
            int4 matmul (w8a8: one per-token activation quantization and one int8 matmul) each
            (:func:`specdec.models.fused.fuse_projections`; bitwise the same outputs, checked per
            layer when loading; fewer, larger calls per token).
        tokenizer: use this tokenizer instead of reading the model folder's (a caller that holds
            the same one: the draft replica shares the target's when
            :func:`specdec.models.vocab.same_tokenizer_files`; a loaded tokenizer takes ~150 MiB for
            the demo pair's). A GGUF spec loaded with ``cache_gguf=False`` reads its own.

    Returns:
        A :class:`LoadedModel`; ``name`` is e.g. ``"demo target (Qwen2.5-Coder-1.5B-Instruct)"``,
        ``"SmolLM2-135M-Instruct.Q4_1.gguf"`` or ``"<model name> (<folder>)"``.

    Raises:
        ModelLoadError: the path is missing or unreadable, a demo package is missing, a sha256 does
            not match, transformers cannot load the model, or the format is unknown;
            ``vocab_subset`` outside 1..emittable vocabulary (or, for int4, not a multiple of 16).
        ModelCompatibilityError: the frequency table was made for another tokenizer.
    """
    t0 = time.perf_counter()
    fmt = resolve_format(spec, weight_format, dtype, device)
    act = formats.compute_dtype(fmt)
    folder: Path | None = None
    if isinstance(spec, GGUFModelSpec) and not cache_gguf:
        path = Path(spec.path).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        model, tokenizer = convert.load_gguf(path, act)
        loaded = _wrap(path.name, model.to(device), tokenizer)
    else:
        folder = spec_folder(spec, fmt)
        loaded = _load_folder(folder, model_name(spec, folder), act, device, tokenizer)
    if vocab_subset is not None:
        from specdec.models.vocab_subset import FrequencyTable, slice_output_layer, subset_ids

        table = vocab_table if isinstance(vocab_table, FrequencyTable) else FrequencyTable.load(vocab_table)
        ids = subset_ids(table, loaded.tokenizer, vocab_subset, loaded.emittable_vocab,
                         always=loaded.eos_token_ids, model_name=loaded.name)  # checks 1..emittable first
        if fmt == "int4" and vocab_subset % 16:
            raise ModelLoadError(
                f"draft vocabulary subset {vocab_subset} with weight format int4: the int4 kernel packs output rows "
                "in groups of 16, so the subset must be a multiple of 16 (e.g. 16384 or 32768)")
        slice_output_layer(loaded.model, ids)  # before quantizing: int8/int4/w8a8 quantize the sliced rows
        loaded.vocab_subset = ids.to(loaded.device)
    t_load = time.perf_counter() - t0
    variant = None
    if loaded.vocab_subset is not None:  # the output layer is sliced: its own cache entry
        import hashlib

        ids = loaded.vocab_subset.cpu().numpy().tobytes()
        variant = f"vocab{len(loaded.vocab_subset)}-{hashlib.sha256(ids).hexdigest()[:12]}"
    loaded.quant_cache = quant_cache.quantize_cached(loaded.model, fmt, folder, variant=variant)
    loaded.weight_format = fmt
    fused = 0
    if fuse and fmt in formats.FUSED_FORMATS:
        from specdec.models.fused import fuse_projections

        fused = fuse_projections(loaded.model)
    prepacked = 0
    if fmt in formats.W8A8_FORMATS:  # every kernel's packed weight now, in parallel threads (else one by one at first use)
        from specdec.models.quant_linear import prepack_all

        prepacked = prepack_all(loaded.model.modules())
    t_quant = time.perf_counter() - t0 - t_load
    if invariant is None:
        invariant = fmt != "float32"
    if invariant:
        from specdec.engine.invariant import make_invariant

        make_invariant(loaded.model, need_rows=need_rows, attention=attention)
        loaded.invariant = True
    if fmt in formats.QUANTIZED_FORMATS:
        from specdec.models.release import release_after_load

        release_after_load(loaded.model)  # w8a8 prepacked now; file pages no tensor uses dropped
    log.info("loaded %s as %s in %.1f s (read %.1f s, quantize %.1f s [cache: %s, %d projection groups fused, "
             "%d layers prepacked], invariance plan %.1f s; %d positions, %d vocab rows, %s)", loaded.name, fmt,
             time.perf_counter() - t0, t_load, t_quant, loaded.quant_cache, fused, prepacked,
             time.perf_counter() - t0 - t_load - t_quant,
             loaded.max_positions, loaded.vocab_rows,
             "all scored" if loaded.vocab_subset is None else f"{len(loaded.vocab_subset)} scored")
    return loaded


def resolve_format(spec: ModelSpec | None, weight_format: str | None = None, dtype: torch.dtype | None = None,
                   device: str | torch.device = "cpu") -> str:
    """The weight format a load uses: argument, else ``dtype``, else the spec's, else
    ``$SPECDEC_WEIGHT_FORMAT``, else the device default.

    Raises:
        ModelLoadError: an unknown format or an unsupported dtype; a set ``$SPECDEC_WEIGHT_FORMAT``
            that names no format, even when a format is given (as every entry point:
            :func:`specdec.models.formats.env_format`).
    """
    formats.env_format(ModelLoadError)
    fmt = weight_format
    if fmt is None and dtype is not None:
        fmt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)
        if fmt is None:
            raise ModelLoadError(f"unsupported dtype {dtype}; give a weight format instead")
    if fmt is None and spec is not None:
        fmt = getattr(spec, "format", None)
    try:
        return formats.check_format(fmt or formats.default_format(device))
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def load_pair(
    pair: ModelPairSpec,
    *,
    weight_format: str | None = None,
    draft_format: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    draft_vocab_subset: int | None = None,
    draft_vocab_table: "str | Path | None" = None,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[LoadedModel, LoadedModel | None]:
    """Load ``(target, draft)`` (draft None when the pair has none) and check they fit together.

    Both forwards are made shape-invariant: the target's for exact speculation, the draft's so
    that a seeded sampled request gives the same output when a session is rebuilt from its
    token history (one prefill instead of many decode steps). Formats: ``weight_format`` for the target (and the draft when
    ``draft_format`` is None), else each spec's own (see :func:`load_model`); a draft with no format
    named anywhere gets :func:`specdec.models.formats.default_draft_format` (int4 on a VNNI CPU
    without AMX, where the target's default is w8a8).
    ``draft_vocab_subset``: the draft scores only that many most frequent ids (FR-Spec,
    :mod:`specdec.models.vocab_subset`; ``draft_vocab_table``: its frequency table, None: the
    shipped one); the target always scores the full vocabulary. ``target_tokenizer``: the target's,
    already read (:func:`read_model_facts`), instead of reading it again.

    Raises:
        ModelLoadError: either model cannot be loaded; a set ``$SPECDEC_WEIGHT_FORMAT`` names no
            format (before loading either, even when both formats are given).
        ModelCompatibilityError: the draft's vocabulary or special ids differ from the target's.
    """
    formats.env_format(ModelLoadError)
    target = load_model(pair.target, weight_format=weight_format, dtype=dtype, device=device,
                        tokenizer=target_tokenizer)
    if pair.draft is None:
        return target, None
    draft_fmt = draft_format or weight_format
    if draft_fmt is None and dtype is None and getattr(pair.draft, "format", None) is None:
        # int4 where the target's default is w8a8 on VNNI; $SPECDEC_WEIGHT_FORMAT when set (checked above)
        draft_fmt = formats.default_draft_format(device)
    draft = load_model(pair.draft, weight_format=draft_fmt, dtype=dtype, device=device,
                       vocab_subset=draft_vocab_subset, vocab_table=draft_vocab_table)
    check_pair_compatible(draft, target)
    return target, draft


def spec_folder(spec: ModelSpec, weight_format: str) -> Path:
    """The Hugging Face folder :func:`load_model` loads ``spec`` from in ``weight_format`` (GGUF:
    the cached conversion), built if need be, without loading weights: a demo role is assembled
    into the cache once, a GGUF file converted once; an HF folder is itself.

    Raises:
        ModelLoadError: a demo package is missing, a sha256 does not match, or the GGUF file
            cannot be converted.
    """
    store = formats.storage_dtype(weight_format)
    if isinstance(spec, DemoModelSpec):
        return demo.ensure_demo_folder(spec.role, dtype=store)
    if isinstance(spec, GGUFModelSpec):
        return convert.cached_gguf_folder(Path(spec.path).expanduser(), dtype=store)
    if isinstance(spec, HFModelSpec):
        return Path(spec.path).expanduser()
    raise TypeError(f"not a model spec: {spec!r}")


def model_name(spec: ModelSpec, folder: Path) -> str:
    """:attr:`LoadedModel.name` of ``spec`` loaded from ``folder`` (:func:`spec_folder`): e.g.
    ``"demo target (Qwen2.5-Coder-1.5B-Instruct)"``, ``"SmolLM2-135M-Instruct.Q4_1.gguf"`` or
    ``"<model name> (<folder>)"``."""
    if isinstance(spec, DemoModelSpec):
        return f"demo {spec.role} ({demo.demo_model(spec.role).model_name})"
    if isinstance(spec, GGUFModelSpec):
        return Path(spec.path).expanduser().name
    marker = cache.read_marker(folder)
    return f"{marker['name']} ({folder})" if marker and marker.get("name") else str(folder)


@dataclass(frozen=True)
class ModelFacts:
    """What a model's tokenizer and config files say, read without its weights
    (:func:`read_model_facts`): enough to tokenize a prompt and check it against the context.

    Attributes:
        name: :attr:`LoadedModel.name` the load will give it.
        folder: the folder the load reads (:func:`spec_folder`).
        tokenizer: its tokenizer (pass it to :func:`load_model` so it is not read twice).
        max_positions: context limit in tokens (``config.max_position_embeddings``).
        vocab_rows: logits width (``config.vocab_size``).
    """

    name: str
    folder: Path
    tokenizer: PreTrainedTokenizerBase
    max_positions: int
    vocab_rows: int

    @property
    def emittable_vocab(self) -> int:
        """As :attr:`LoadedModel.emittable_vocab`."""
        return min(len(self.tokenizer), self.vocab_rows)


def read_model_facts(spec: ModelSpec, weight_format: str) -> ModelFacts:
    """The tokenizer and limits of ``spec`` in ``weight_format`` from its folder's tokenizer and
    config files (a fraction of a second), building the folder as :func:`load_model` would
    (:func:`spec_folder`) but loading no weights.

    Raises:
        ModelLoadError: as :func:`spec_folder`, or the tokenizer or config cannot be read.
    """
    from transformers import AutoConfig

    folder = spec_folder(spec, weight_format)
    name = model_name(spec, folder)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load model {name}: {e}") from e
    return ModelFacts(name, folder, tokenizer, int(config.max_position_embeddings), int(config.vocab_size))


def resolve_folder(spec_text: str, weight_format: str | None = None) -> str:
    """The Hugging Face folder model spec ``spec_text`` loads from in ``weight_format``, without
    loading weights (the cache keeps float32 and bfloat16 copies: :func:`formats.storage_dtype`);
    ``weight_format`` None: :func:`formats.default_format` of the CPU.

    A demo role is assembled into the cache once, a GGUF file converted once and cached (the
    folder :func:`load_model` would load); an HF folder is itself. Tensor-parallel loading and
    the serving layer's tokenizer/config reads need a folder.

    Raises:
        ModelLoadError: a demo package is missing, a sha256 does not match, or the GGUF file
            cannot be converted.
    """
    return str(spec_folder(parse_model_spec(spec_text), weight_format or formats.default_format("cpu")))


def _load_folder(folder: Path, name: str, dtype: torch.dtype, device: str | torch.device,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> LoadedModel:
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    try:
        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load model {name}: {e}") from e
    return _wrap(name, model.to(device), tokenizer)


def _wrap(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    model.eval()
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        max_positions=int(model.config.max_position_embeddings),
        vocab_rows=int(model.get_output_embeddings().weight.shape[0]),
    )
