"""Weight formats (float32, bfloat16, float16, int8, int4, w8a8, w7a8) and the shape-invariant forward.

For every format the README offers: loading gives the right layers; a position's logits are
bitwise the same whether it is decoded alone, verified inside a block or computed in a prefill;
greedy speculative output equals the target alone in the same format; sampled output follows the
target's distribution (chi-square). Tiny models (hidden size 64), so every format runs in seconds.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from specdec.engine.engine import SpeculativeEngine
from specdec.engine.invariant import ATTENTION_NAME, UNCHUNKED_ROWS, RowPlan, plan_linear, run_rows
from specdec.errors import ModelLoadError
from specdec.models.formats import WEIGHT_FORMATS, Int8WeightOnlyLinear, W8A8Linear, compute_dtype, weight_bytes
from specdec.models.loader import load_model
from specdec.models.spec import HFModelSpec
from specdec.request import GenerationRequest
from specdec.testing.tiny import build_tiny_model
from tests.conftest import target_greedy
from tests.test_engine import test_speculative_samples_follow_target_distribution as chi_square_check

MAX_NEW = 20


@pytest.fixture(scope="module", autouse=True)
def w8a8_qlinear_everywhere():
    """The tiny models' layers are narrower than W8A8Linear.QLINEAR_MIN_OUT: run oneDNN's qlinear
    on all of them here, as on the demo target's wide layers (int_mm is tested against it)."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(W8A8Linear, "QLINEAR_MIN_OUT", 0)
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    target = build_tiny_model(d / "target", seed=0)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(target)
    draft = build_tiny_model(d / "draft", seed=1, base=base, noise=0.03)
    return target, draft


_pairs: dict = {}


def pair(folders, fmt):
    if fmt not in _pairs:
        # invariant forced on: float32 too (it is off there by default)
        target = load_model(HFModelSpec(path=folders[0]), weight_format=fmt, invariant=True)
        draft = load_model(HFModelSpec(path=folders[1]), weight_format=fmt, invariant=True)
        _pairs[fmt] = (target, draft)
    return _pairs[fmt]


def _prompts(vocab):
    rng = random.Random(99)
    # 45 tokens: a prefill longer than the 32 rows bfloat16 kernels keep invariant
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 6, 45)]


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_load_in_format(folders, fmt):
    target, draft = pair(folders, fmt)
    assert (target.weight_format, target.invariant) == (fmt, True)
    assert (draft.weight_format, draft.invariant) == (fmt, True)
    assert target.model.config._attn_implementation == ATTENTION_NAME
    proj = target.model.model.layers[0].mlp.down_proj  # up_proj is fused with gate_proj in int4 (specdec.models.fused)
    if fmt == "int8":
        assert isinstance(proj, Int8WeightOnlyLinear) and proj.qweight.dtype == torch.int8
    elif fmt == "int4":
        assert type(proj.weight).__name__ == "Int4OpaqueTensor"
    elif fmt in ("w8a8", "w7a8"):
        assert isinstance(proj, W8A8Linear) and proj.qweight.dtype == torch.int8 and proj.scale.dtype == torch.float32
        assert proj._specdec_plan == RowPlan(1, UNCHUNKED_ROWS)  # row-exact: never chunked
        assert isinstance(target.model.lm_head, W8A8Linear)
        layers = [m for m in target.model.modules() if isinstance(m, W8A8Linear)]
        assert len(layers) == 2 * 4 + 1 and all(m.one_pass == (fmt == "w7a8") for m in layers)  # fused qkv, o, gate_up, down
    else:
        assert isinstance(proj, nn.Linear) and proj.weight.dtype == compute_dtype(fmt)
    assert target.model.model.embed_tokens.weight.dtype == compute_dtype(fmt)
    fp32 = weight_bytes(pair(folders, "float32")[0].model)
    expected = {"float32": 1.0, "bfloat16": 0.51, "float16": 0.51, "int8": 0.51, "int4": 0.51, "w8a8": 0.51, "w7a8": 0.51}[fmt]
    assert weight_bytes(target.model) <= expected * fp32
    assert target.vocab_rows == 320


@pytest.mark.parametrize("fmt", ["w8a8", "w7a8"])
def test_w7a8_quantizes_the_weights_to_seven_bits(folders, fmt):
    """w7a8 is w8a8 with torchao's reduce_range: weight codes -64..63 (one scale per row), the
    activations still int8 per token (W8A8Linear's own)."""
    from transformers import AutoModelForCausalLM

    from specdec.models.formats import quantize

    model = AutoModelForCausalLM.from_pretrained(folders[0], dtype=torch.bfloat16)
    quantize(model, fmt)
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    lo = min(int(m.qweight.min()) for m in layers)
    hi = max(int(m.qweight.max()) for m in layers)
    assert (lo, hi) == ((-64, 63) if fmt == "w7a8" else (-128, 127))
    assert all(m.one_pass == (fmt == "w7a8") for m in layers)


def test_float32_is_not_made_invariant_by_default(folders):
    m = load_model(HFModelSpec(path=folders[0]), weight_format="float32")
    assert not m.invariant and m.model.config._attn_implementation != ATTENTION_NAME
    assert load_model(HFModelSpec(path=folders[0]), weight_format="bfloat16").invariant


def test_unknown_format_is_refused(folders):
    with pytest.raises(ModelLoadError, match="unknown weight format 'int3'; expected one of float32, bfloat16, float16, int8, int4, w8a8, w7a8$"):
        load_model(HFModelSpec(path=folders[0]), weight_format="int3")
    with pytest.raises(ValueError, match="format"):
        HFModelSpec(path=folders[0], format="int3")


def _logits_by_chunks(model, ids, first, chunk):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids[:first]]), cache=cache, use_cache=True)
        rows = [out.logits[0].float()]
        pos = first
        while pos < len(ids):
            out = model(input_ids=torch.tensor([ids[pos:pos + chunk]]), cache=cache, use_cache=True)
            rows.append(out.logits[0].float())
            pos += chunk
    return torch.cat(rows)


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_logits_do_not_depend_on_positions_per_forward(folders, fmt):
    """Plain decoding, blocks of 2..17 positions and one 70-position prefill give equal logits."""
    target, _ = pair(folders, fmt)
    ids = [random.Random(5).randrange(3, 320) for _ in range(70)]
    ref = _logits_by_chunks(target.model, ids, 4, 1)
    for first, chunk in ((4, 2), (4, 5), (4, 17), (40, 3), (70, 1)):
        got = _logits_by_chunks(target.model, ids, first, chunk)
        assert torch.equal(got, ref), (fmt, first, chunk, (got - ref).abs().max().item())


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_speculation_equals_target_alone(folders, fmt, k):
    target, draft = pair(folders, fmt)
    engine = SpeculativeEngine(target, draft)
    for prompt in _prompts(target.emittable_vocab):
        ref = target_greedy(target, prompt, MAX_NEW)
        for proposer in ("draft", "ngram"):
            res = engine.generate(GenerationRequest(prompt_token_ids=prompt, max_tokens=MAX_NEW,
                                                    speculation={"proposer": proposer, "k": k}))
            assert res.token_ids == ref, (fmt, k, proposer, len(prompt))
        plain = engine.generate(GenerationRequest(prompt_token_ids=prompt, max_tokens=MAX_NEW,
                                                  speculation={"proposer": "none", "k": 0}))
        assert plain.token_ids == ref


@pytest.mark.parametrize("fmt", [f for f in WEIGHT_FORMATS if f != "float32"])  # float32: tests/test_engine.py
def test_sampling_follows_target_distribution(folders, fmt):
    """The chi-square test of tests/test_engine.py on 600 seeded requests per format."""
    target, draft = pair(folders, fmt)
    chi_square_check(target, draft, "draft", n=600)


def test_row_plans_follow_the_kernels():
    """float32 (MKL) rows depend on the row count, so it gets fixed-size calls; int8 does not."""
    lin = nn.Linear(64, 96)
    plan32 = plan_linear(lambda x: nn.functional.linear(x, lin.weight, lin.bias), 64, torch.float32, "cpu", 17)
    q = Int8WeightOnlyLinear(torch.randint(-127, 127, (96, 64), dtype=torch.int8), torch.rand(96) / 100, None)
    plan8 = plan_linear(q.forward_rows, 64, torch.bfloat16, "cpu", 17)
    assert plan8 == RowPlan(1, 32)
    assert plan32.max_rows >= 17 or plan32 == RowPlan(8, 8)
    x = torch.randn(21, 64)
    f = lambda t: nn.functional.linear(t, lin.weight, lin.bias)  # noqa: E731
    y = run_rows(f, x, RowPlan(8, 8))  # 8 + 8 + 5 (padded to 8) rows
    assert y.shape == (21, 96)
    assert torch.equal(y[16:], f(torch.cat([x[16:], torch.zeros(3, 64)]))[:5])


def test_make_invariant_probes_row_exact_layers_at_fewer_row_counts(folders):
    """A layer that is row-exact by construction (w8a8) is probed at ROW_EXACT_PROBE_ROWS, once per
    layer shape, and left unchunked; other kernels are probed at every PROBE_ROWS count."""
    from specdec.engine import invariant

    loaded = load_model(HFModelSpec(path=folders[0]), weight_format="w8a8", invariant=False)
    seen: dict[tuple, list[list[int]]] = {}
    layers = [m for m in loaded.model.modules() if isinstance(m, W8A8Linear)]
    for m in layers:
        calls = seen.setdefault((m.in_features, m.out_features), [])
        mine: list[int] = []
        calls.append(mine)
        real = m.forward_rows
        m.forward_rows = lambda x, _real=real, _mine=mine: _mine.append(x.shape[0]) or _real(x)
    plans = invariant.make_invariant(loaded.model, need_rows=17)
    n = max(invariant.ROW_EXACT_PROBE_ROWS)
    assert len(plans) == len(seen) and len(layers) > len(seen)
    for shape, calls in seen.items():  # the first layer of a shape is probed, the others reuse its plan
        assert calls[0] == [1] * n + list(invariant.ROW_EXACT_PROBE_ROWS), shape
        assert all(c == [] for c in calls[1:]), shape
    assert all(m._specdec_plan == RowPlan(1, UNCHUNKED_ROWS) for m in layers)

    q = Int8WeightOnlyLinear(torch.randint(-127, 127, (96, 64), dtype=torch.int8), torch.rand(96) / 100, None)
    rows: list[int] = []
    plan = plan_linear(lambda x: rows.append(x.shape[0]) or q.forward_rows(x), 64, torch.bfloat16, "cpu", 17)
    assert plan == RowPlan(1, 32) and rows == [1] * max(invariant.PROBE_ROWS) + list(invariant.PROBE_ROWS)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "w8a8"])
def test_left_padded_batch_rows_equal_each_sequence_alone(folders, fmt):
    """Row-wise attention slices each row's visible keys, so padding a sequence into a batch
    (issue 10) does not change its logits."""
    target, _ = pair(folders, fmt)
    rng = random.Random(11)
    a = [rng.randrange(3, 320) for _ in range(5)]
    b = [rng.randrange(3, 320) for _ in range(9)]
    ids = torch.tensor([[0] * 4 + a, b])
    mask = torch.tensor([[0] * 4 + [1] * 5, [1] * 9])
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.inference_mode():
        both = target.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        alone_a = target.model(input_ids=torch.tensor([a])).logits[0].float()
        alone_b = target.model(input_ids=torch.tensor([b])).logits[0].float()
    assert torch.equal(both[0, 4:], alone_a)
    assert torch.equal(both[1], alone_b)


def test_default_format_follows_the_cpu(monkeypatch):
    from specdec.models import formats

    avx512_bf16 = {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert formats.choose_cpu_format(avx512_bf16, "AVX512") == formats.CPU_BF16_DEFAULT == "int4"
    assert formats.choose_cpu_format({"avx2", "amx_bf16", "avx512f"}, "AVX512") == "int4"
    sapphire_rapids = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"}
    assert formats.choose_cpu_format(sapphire_rapids, "AVX512") == formats.CPU_AMX_INT8_DEFAULT == "w8a8"
    assert formats.choose_cpu_format(sapphire_rapids, "AVX2", fbgemm=False) == "int4"  # torch on its AVX2 kernels
    assert formats.choose_cpu_format({"avx2", "avx512f", "avx512_vnni"}, "AVX512") == "float32"  # no bf16
    # AMD EPYC (Zen 4/5): AVX512-VNNI and -BF16, no AMX: w8a8 (oneDNN's VNNI int8 matmul on uint8 codes)
    epyc = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"}
    assert formats.choose_cpu_format(epyc, "AVX512") == "w8a8"
    assert formats.choose_cpu_format(epyc - {"avx512_vnni"}, "AVX512") == "int4"
    # torch on its AVX2 kernels (no AVX-512; the AVX2-only AMD EPYC Zen 3 of sessions 12 and 16): w8a8 on
    # fbgemm (session 16: target alone 1.77x int4's tokens/s), int4 where torch has no fbgemm engine
    zen3 = {"fpu", "avx", "avx2", "fma", "f16c", "bmi2", "sha_ni"}
    assert formats.choose_cpu_format(zen3, "AVX2", fbgemm=True) == formats.CPU_AVX2_DEFAULT == "w7a8"
    assert formats.choose_cpu_format(zen3, "AVX2", fbgemm=False) == formats.CPU_AVX2_FALLBACK_DEFAULT == "int4"
    assert formats.choose_cpu_format(epyc, "AVX2", fbgemm=True) == "w7a8"
    assert formats.choose_cpu_format(avx512_bf16, "AVX2", fbgemm=False) == "int4"  # torch not using AVX512 kernels
    from specdec.models.quant_linear import fbgemm_available
    assert formats.choose_cpu_format(zen3, "AVX2") == ("w7a8" if fbgemm_available() else "int4")
    assert formats.choose_cpu_format({"sse4_2"}, "DEFAULT") == "float32"  # no AVX2: not measured
    assert formats.choose_cpu_format({"avx2", "avx512f"}, "AVX512") == "float32"  # AVX-512 without bf16/VNNI
    monkeypatch.delenv("SPECDEC_WEIGHT_FORMAT")
    assert formats.default_format("cuda") == "bfloat16"
    here = formats.choose_cpu_format(formats.cpu_flags(), torch.backends.cpu.get_cpu_capability())
    assert formats.default_format("cpu") == here
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", "int8")
    assert formats.default_format("cpu") == "int8"
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", "int3")
    with pytest.raises(ValueError) as e:
        formats.default_format("cpu")
    assert str(e.value) == ("SPECDEC_WEIGHT_FORMAT='int3' is not a weight format; known formats: "
                            "float32, bfloat16, float16, int8, int4, w8a8, w7a8")


@pytest.mark.parametrize("value", ["W7A8", " w7a8 ", "w7a8\n", "W7a8"])
def test_the_environments_format_is_case_insensitive_and_stripped(monkeypatch, value):
    from specdec.models import formats

    """``SPECDEC_WEIGHT_FORMAT=W7A8`` raised a bare "unknown weight format 'W7A8'" ValueError in the
    Python API: the variable is typed by hand, so its case and surrounding spaces do not matter."""
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", value)
    assert formats.env_format() == "w7a8"
    assert formats.default_format("cpu") == formats.default_format("cuda") == "w7a8"
    assert formats.default_draft_format("cpu") == "w7a8"


def test_a_blank_environment_format_is_unset(monkeypatch):
    from specdec.models import formats

    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", "  ")
    assert formats.env_format() is None
    assert formats.default_format("cuda") == "bfloat16"


def test_typed_format_names_are_exact_and_refused_with_the_choices():
    """Only the environment variable is read case-insensitively (README "Weight formats"): a spec's
    ``format``, ``AppConfig.target_dtype``/``draft_dtype`` and ``weight_format=`` take the lower-case
    names and refuse another with the known formats."""
    import pydantic

    from specdec.errors import ModelLoadError
    from specdec.models.loader import resolve_format
    from specdec.models.spec import DemoModelSpec

    choices = "'float32', 'bfloat16', 'float16', 'int8', 'int4', 'w8a8' or 'w7a8'"
    with pytest.raises(pydantic.ValidationError, match=choices):
        DemoModelSpec(role="target", format="W7A8")
    with pytest.raises(ModelLoadError) as e:
        resolve_format(None, "W7A8")
    assert str(e.value) == ("unknown weight format 'W7A8'; expected one of "
                            "float32, bfloat16, float16, int8, int4, w8a8, w7a8")


def test_cpu_flags_reads_proc_cpuinfo(tmp_path):
    from specdec.models.formats import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_int4_leaves_layers_the_kernel_cannot_pack_in_bfloat16():
    from specdec.models.formats import quantize

    model = nn.Sequential(nn.Linear(64, 330), nn.Linear(330, 64), nn.Linear(64, 320)).to(torch.bfloat16)
    quantize(model, "int4")
    kinds = [type(m.weight.data).__name__ for m in model]
    assert kinds == ["Tensor", "Tensor", "Int4OpaqueTensor"]  # 330 rows: not packable; 330 wide: no group
    assert model(torch.randn(3, 64, dtype=torch.bfloat16)).shape == (3, 320)


def _w8a8_layer(out_features, in_features, seed, bias=True):
    from specdec.models.formats import quantize

    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(out_features, generator=g))
    ref = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    ref.load_state_dict(lin.state_dict())
    model = nn.Sequential(lin)
    quantize(model, "w8a8")
    return ref, model[0]


@pytest.mark.parametrize("shape", [(96, 64), (1536, 256), (320, 1024)])
def test_w8a8_row_is_the_same_at_every_row_count(shape, monkeypatch, onednn_int8_prepack):
    """A w8a8 layer's row is bitwise the same computed alone or among 2..40 rows (per-row
    activation scales, exact int32 sums), also next to rows of very different magnitude, with
    either kernel; and, on a CPU where its int8 sums are exact (VNNI, AMX-INT8), oneDNN's prepacked
    qlinear gives bitwise aten._int_mm's result (an AVX2-only CPU's saturating kernel is still
    row-exact, but the layer does not use it there)."""
    monkeypatch.setattr(W8A8Linear, "KEEP_INT8", True)  # keep qweight for the int_mm kernel
    _, q = _w8a8_layer(*shape, seed=shape[0])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, shape[1], generator=g).to(torch.bfloat16)
    x[7] *= 300  # an outlier row: must not change the other rows' scales
    x[9] = 0  # an all-zero row (padding): zeros plus bias
    by_kernel = {}
    with torch.inference_mode():
        for kernel in ("qlinear", "int_mm"):
            monkeypatch.setattr(W8A8Linear, "KERNEL", kernel)
            alone = torch.cat([q.forward_rows(x[i:i + 1]) for i in range(40)])
            for m in range(1, 41):
                assert torch.equal(q.forward_rows(x[:m]), alone[:m]), (kernel, m)
            assert torch.equal(q.forward_rows(x[9:10])[0], q.bias.to(torch.bfloat16))
            assert torch.equal(q(x.view(4, 10, -1)), alone.view(4, 10, -1))
            by_kernel[kernel] = alone
    assert q._packed is not False  # the prepacked oneDNN weight was built (x86 CPU)
    if onednn_int8_prepack:  # exact int32 sums on this CPU
        assert torch.equal(by_kernel["qlinear"], by_kernel["int_mm"])


def test_w8a8_narrow_layers_run_int_mm(monkeypatch, onednn_int8_prepack):
    """Below QLINEAR_MIN_OUT outputs the layer runs aten._int_mm and keeps its int8 weight."""
    monkeypatch.setattr(W8A8Linear, "QLINEAR_MIN_OUT", 1024)
    _, narrow = _w8a8_layer(256, 64, seed=5)
    _, wide = _w8a8_layer(1024, 64, seed=6)
    with torch.inference_mode():
        narrow(torch.randn(2, 64, dtype=torch.bfloat16))
        wide(torch.randn(2, 64, dtype=torch.bfloat16))
    assert narrow._packed is None and narrow.qweight.shape == (256, 64)
    assert wide.prepacked and wide.weight.shape == (1024, 64)


@pytest.fixture
def fbgemm_cpu(monkeypatch):
    """W8A8Linear runs as on a CPU whose oneDNN int8 sums are not exact (AVX2 only): fbgemm."""
    import specdec.models.quant_linear as ql

    if not ql.fbgemm_available():
        pytest.skip("this torch has no fbgemm quantized engine (not an x86 build)")
    monkeypatch.setattr(ql, "this_cpu_onednn_int8_exact", lambda: False)


@pytest.mark.parametrize("shape", [(2048, 1536), (96, 8960), (16, 64)])
def test_w7a8_fbgemm_one_pass_gives_int_mm_bitwise(shape, fbgemm_cpu, monkeypatch):
    """7-bit weights (w7a8; -64..64 is the bound) go through fbgemm in one pass per row, uint8
    codes q + 128: bitwise aten._int_mm's result also for the extreme codes against weights of
    -64 and 64 at 8,960 inputs (sums of 72.8 M, beyond float32's 2**24: rounded once, as int_mm's
    int32 converted to float32), and a row is bitwise the same alone or among 1..17 rows. The
    kernel is called once per call with the rows themselves (not the 2M rows of the halves)."""
    import specdec.models.quant_linear as ql

    out, inp = shape
    g = torch.Generator().manual_seed(out)
    w = torch.randint(-64, 65, (out, inp), generator=g, dtype=torch.int8)
    w[0], w[1] = -64, 64
    q = W8A8Linear(w, torch.rand(out, generator=g) / 100 + 1e-4, torch.randn(out, generator=g))
    assert q.one_pass
    x = torch.randn(17, inp, generator=g).to(torch.bfloat16)
    x[0] = 3.0  # every code 127
    x[1] = -2.0  # every code -127
    x[2] = 0  # zeros: the bias
    x[3] *= 1000  # an outlier row
    codes, s = W8A8Linear.quantize_rows(x)
    expected = (torch._int_mm(codes, w.t()).float() * q.scale * s).to(torch.bfloat16) + q.bias
    if inp == 8960:
        assert torch._int_mm(codes[:2], w[:2].t()).abs().max() == 127 * 64 * 8960
    rows = []
    kernel = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32

    class Counting:
        def __call__(self, x, *a):
            rows.append(x.shape[0])
            return kernel(x, *a)

    monkeypatch.setattr(ql.torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", Counting(),
                        raising=False)
    with torch.inference_mode():
        got = q.forward_rows(x)
        alone = torch.cat([q.forward_rows(x[i:i + 1]) for i in range(17)])
        assert q._kind == "fbgemm" and q.prepacked
        for m in (1, 2, 5, 16):
            assert torch.equal(q.forward_rows(x[:m]), alone[:m]), m
    assert rows == [17] + [1] * 17 + [1, 2, 5, 16]
    assert torch.equal(got, expected)
    assert torch.equal(alone, expected)
    # one weight beyond 64: the halves again (a pair 2 * 255 * 65 could pass int16's 32,767)
    w[5, 7] = 65
    assert not W8A8Linear(w, q.scale, None).one_pass


@pytest.mark.parametrize("shape", [(2048, 1536), (96, 8960), (16, 64)])
def test_w8a8_fbgemm_kernel_gives_int_mm_bitwise(shape, fbgemm_cpu):
    """On a CPU without VNNI or AMX-INT8 every w8a8 layer (narrow ones too) runs fbgemm on its
    prepacked weight, fed each row's codes as two 7-bit halves; the result is bitwise aten._int_mm's
    (the layer's definition) also for the extreme codes (every code +-127, whose halves reach -64 and 63)
    against weights of -128 and 127, and a row is bitwise the same alone or among 1..17 rows."""
    out, inp = shape
    g = torch.Generator().manual_seed(out)
    w = torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8)
    w[0], w[1] = -128, 127
    q = W8A8Linear(w, torch.rand(out, generator=g) / 100 + 1e-4, torch.randn(out, generator=g))
    x = torch.randn(17, inp, generator=g).to(torch.bfloat16)
    x[0, ::2], x[0, 1::2] = 3.0, -3.0  # codes 127 and -127
    x[1] = -2.0  # every code -127
    x[2] = 0  # zeros: the bias
    x[3] *= 1000  # an outlier row
    codes, s = W8A8Linear.quantize_rows(x)
    assert codes.abs().max() == 127
    expected = (torch._int_mm(codes, w.t()).float() * q.scale * s).to(torch.bfloat16) + q.bias
    with torch.inference_mode():
        got = q.forward_rows(x)
        alone = torch.cat([q.forward_rows(x[i:i + 1]) for i in range(17)])
        assert q._kind == "fbgemm" and q.prepacked and q.qweight.numel() == 0  # one copy: fbgemm's
        for m in (1, 2, 5, 16):
            assert torch.equal(q.forward_rows(x[:m]), alone[:m]), m
    assert torch.equal(got, expected)
    assert torch.equal(alone, expected)
    assert torch.equal(got[2], torch.zeros(out, dtype=torch.bfloat16) + q.bias)


def test_w8a8_prepack_all_packs_in_threads_bitwise(fbgemm_cpu):
    """prepack_all packs every layer in worker threads (fbgemm's engine switch ref-counted across
    them, the global engine restored after) and each packed layer computes bitwise what a lazily packed one does, which is
    aten._int_mm's result; already packed layers and other modules are skipped."""
    from specdec.models.quant_linear import prepack_all

    engine = torch.backends.quantized.engine
    g = torch.Generator().manual_seed(11)
    ws = [torch.randint(-127, 128, (out, 256), generator=g, dtype=torch.int8) for out in (512, 384, 96, 1024, 640)]
    layers = [W8A8Linear(w, torch.rand(w.shape[0], generator=g) / 100 + 1e-4, None) for w in ws]
    lazy = [W8A8Linear(w, q.scale, None) for w, q in zip(ws, layers)]
    assert prepack_all([layers[0]], workers=1) == 1 and layers[0].prepacked
    assert prepack_all(layers + [nn.Linear(4, 4)], workers=2) == 4  # layers[0] was packed already
    assert all(q.prepacked and q._kind == "fbgemm" for q in layers)
    assert torch.backends.quantized.engine == engine
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    codes, s = W8A8Linear.quantize_rows(x)
    with torch.inference_mode():
        for w, q, ref in zip(ws, layers, lazy):
            expected = (torch._int_mm(codes, w.t()).float() * q.scale * s).to(torch.bfloat16)
            assert torch.equal(q.forward_rows(x), expected)
            assert torch.equal(ref.forward_rows(x), expected) and ref.prepacked  # packed at first use


def test_w8a8_fbgemm_prepack_leaves_the_global_engine_alone(fbgemm_cpu):
    engine = torch.backends.quantized.engine
    q = W8A8Linear(torch.ones(32, 16, dtype=torch.int8), torch.ones(32), None)
    assert q.prepack() and q._kind == "fbgemm"
    assert torch.backends.quantized.engine == engine


def test_w8a8_is_int8_weights_times_per_token_int8_activations():
    """The layer computes ``(round(x / s_x) @ qweight.T) * s_x * scale + bias`` with
    ``s_x = max|x| / 127`` per row, on torchao's per-row int8 weights; close to the bfloat16 layer."""
    lin, q = _w8a8_layer(48, 256, seed=3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    w = q.qweight.float() * q.scale[:, None]
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() == 127
    assert torch.allclose(w, lin.weight.float(), atol=q.scale.max().item() / 2 + 1e-7)  # per-row symmetric int8
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(xf / s)
    assert xq.abs().max() == 127
    expected = ((xq @ q.qweight.float().T) * s * q.scale + q.bias.float()).to(torch.bfloat16)
    with torch.inference_mode():
        got = q(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 48)
    assert torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    ref = nn.functional.linear(x, lin.weight, lin.bias).float()
    rel = (got.float() - ref).norm() / ref.norm()
    assert rel < 0.02, rel.item()


def test_w8a8_layer_checks_its_weights():
    with pytest.raises(ValueError, match="W8A8Linear needs a 2-D int8 weight, got \\(4, 8\\) torch.float32"):
        W8A8Linear(torch.zeros(4, 8), torch.ones(4), None)
    with pytest.raises(ValueError, match="W8A8Linear: 3 weight scales for 4 output rows"):
        W8A8Linear(torch.zeros(4, 8, dtype=torch.int8), torch.ones(3), None)


def test_w8a8_prepacked_layer_keeps_one_copy_of_its_weights(onednn_int8_prepack):
    """After the first forward the int8 weight lives only in oneDNN's prepacked form: qweight is
    empty, weight_bytes still counts one byte per weight, and storing the layer is refused."""
    from specdec.models.quant_cache import quantized_state

    _, q = _w8a8_layer(96, 64, seed=4)
    model = nn.Sequential(q)
    state = quantized_state(model)  # before the first forward: the int8 data
    assert state["0"]["kind"] == "w8a8" and state["0"]["qweight"].shape == (96, 64)
    before = weight_bytes(model)
    with torch.inference_mode():
        y = model(torch.randn(3, 64, dtype=torch.bfloat16))
    assert q.prepacked and q.qweight.numel() == 0 and y.shape == (3, 96)
    assert weight_bytes(model) == before - 96 * 64 + 96 * 64
    with pytest.raises(RuntimeError, match="only in its kernel's prepacked form"):
        quantized_state(model)


def _onednn_matmul_impls(run) -> list[str]:
    """The oneDNN matmul implementations ``run()`` executes (``ONEDNN_VERBOSE`` exec lines)."""
    import os
    import sys
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as f:  # oneDNN prints from C to the process's stdout
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                run()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        lines = f.read().splitlines()
    return [ln.split(",")[6] for ln in lines
            if ln.startswith("onednn_verbose") and ",exec,cpu,matmul," in ln]


def test_w8a8_qlinear_runs_onednn_native_int8_kernel_not_its_reference():
    """oneDNN's qlinear gets uint8 activation codes (int8 codes + 128, zero point 128): on a CPU
    without AMX-INT8 an int8 source made oneDNN run its reference ``ref_int8`` matmul (0.46 s for
    one row of 1536 -> 2048 on the AMD EPYC here, against 0.17 ms on ``brg_matmul``); the integer
    sums and so the output are bitwise those of the int8 codes (aten._int_mm)."""
    from specdec.models.cpu_features import this_cpu_onednn_int8_exact
    from specdec.models.quant_linear import cpu_int8_kernel

    _, q = _w8a8_layer(512, 256, seed=11)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    codes, s = W8A8Linear.quantize_rows(x)
    codes_u8, s_u8 = W8A8Linear.quantize_rows(x, W8A8Linear.U8_ZERO_POINT)
    assert codes_u8.dtype == torch.uint8 and torch.equal(codes_u8.to(torch.int16), codes.to(torch.int16) + 128)
    assert torch.equal(s_u8, s) and int(codes_u8.min()) >= 1
    expected = (torch._int_mm(codes, q.qweight.t()).float() * q.scale * s).to(torch.bfloat16) + q.bias
    with torch.inference_mode():
        q.forward_rows(x)  # prepacks
        got = {}
        impls = _onednn_matmul_impls(lambda: got.update({m: q.forward_rows(x[:m]) for m in (1, 5)}))
    assert torch.equal(got[5], expected) and torch.equal(got[1], expected[:1])
    if this_cpu_onednn_int8_exact():  # VNNI or AMX-INT8: oneDNN's native kernel, one matmul per call
        assert q.prepacked and len(impls) == 2, impls
        assert not [i for i in impls if i.startswith("ref")], impls
    else:  # e.g. AVX2 only: oneDNN would saturate int16 pairs, so the layer runs fbgemm (or int_mm)
        assert impls == [] and q._kind == cpu_int8_kernel() and q.prepacked == (q._kind == "fbgemm")


def test_onednn_int8_exact_needs_a_vnni_or_amx_int8_flag():
    """oneDNN's u8 x s8 sums are exact only with int32 dot products (VNNI, AVX-VNNI, AMX-INT8);
    an AVX2-only CPU (AMD EPYC Zen 3) or AVX-512 without VNNI (Skylake-SP) is not."""
    from specdec.models.cpu_features import onednn_int8_exact

    assert onednn_int8_exact({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
    assert onednn_int8_exact({"avx2", "avx_vnni"})
    assert onednn_int8_exact({"avx512f", "amx_int8", "amx_bf16"})
    assert not onednn_int8_exact({"avx2", "fma", "f16c"})
    assert not onednn_int8_exact({"avx2", "avx512f", "avx512bw"})
    assert not onednn_int8_exact(frozenset())


def test_w8a8_without_exact_int8_dot_products_or_fbgemm_runs_int_mm_and_keeps_its_bits(monkeypatch):
    """On a CPU whose oneDNN int8 kernel saturates (no VNNI, no AMX-INT8) and a torch without the
    fbgemm engine the layer never prepacks: it keeps its int8 rows and gives aten._int_mm's exact
    sums, row by row as in a batch. Measured on the AVX2-only EPYC of 2 Dec 2026, oneDNN's kernel
    was up to 15 % off these sums."""
    import specdec.models.quant_linear as ql

    monkeypatch.setattr(ql, "this_cpu_onednn_int8_exact", lambda: False)
    monkeypatch.setattr(ql, "fbgemm_available", lambda: False)
    assert ql.cpu_int8_kernel() == "int_mm"
    _, q = _w8a8_layer(512, 256, seed=12)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    codes, s = W8A8Linear.quantize_rows(x)
    expected = (torch._int_mm(codes, q.qweight.t()).float() * q.scale * s).to(torch.bfloat16) + q.bias
    with torch.inference_mode():
        assert q.prepack() is False
        got = q.forward_rows(x)
        rows = [q.forward_rows(x[i:i + 1]) for i in range(4)]
    assert not q.prepacked and q.qweight.shape == (512, 256)
    assert torch.equal(got, expected) and torch.equal(torch.cat(rows), expected)
