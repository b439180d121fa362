"""The wire contract: stubs are fresh, the schema follows the lint rules, blocks stay small."""

from __future__ import annotations

import filecmp
import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_committed_stubs_equal_regenerated(tmp_path):
    # Regenerating from the .proto files gives the committed files byte for byte.
    gen = _load_gen_protos()
    written = gen.generate(tmp_path)
    assert written
    for path in written:
        rel = path.relative_to(tmp_path)
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed: run python scripts/gen_protos.py"
        assert filecmp.cmp(path, committed, shallow=False), f"{rel} is stale: run python scripts/gen_protos.py"
    generated = {p.relative_to(ROOT) for p in (ROOT / "protos").rglob("*") if p.suffix in (".py", ".pyi")}
    assert generated == {p.relative_to(tmp_path) for p in written}, "stray generated files under protos/"


def test_import_path_equals_directory():
    from protos.specdec.v1 import exchange_pb2, specdec_pb2, specdec_pb2_grpc

    assert specdec_pb2.DESCRIPTOR.name == "protos/specdec/v1/specdec.proto"
    assert specdec_pb2.DESCRIPTOR.package == "specdec.v1"
    assert exchange_pb2.DESCRIPTOR.package == "specdec.v1"
    assert hasattr(specdec_pb2_grpc, "add_SpecDecServicer_to_server")


def _comment_lines_before(lines: list[str], i: int) -> bool:
    return i > 0 and lines[i - 1].strip().startswith("//")


@pytest.mark.parametrize("name", ["specdec.proto", "exchange.proto"])
def test_every_declaration_has_a_comment(name):
    # buf-lint style: services, rpcs, messages, enums, enum values and fields are documented.
    lines = (ROOT / "protos/specdec/v1" / name).read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("//") or s in ("}", "};") or s.startswith(("syntax", "package", "import")):
            continue
        if not _comment_lines_before(lines, i):
            undocumented.append(f"{name}:{i + 1}: {s}")
    assert not undocumented, "\n".join(undocumented)


def test_enums_start_with_unspecified():
    from protos.specdec.v1 import exchange_pb2, specdec_pb2

    for fd in (specdec_pb2.DESCRIPTOR, exchange_pb2.DESCRIPTOR):
        for enum in fd.enum_types_by_name.values():
            zero = enum.values_by_number[0].name
            assert zero.endswith("_UNSPECIFIED"), (enum.name, zero)


def _block(k: int, m: int, vocab: int = 151_936, seed: int = 0):
    from protos.specdec.v1 import exchange_pb2

    rng = random.Random(seed)
    ids = [rng.randrange(vocab) for _ in range(k * m)]
    probs = [rng.random() for _ in range(k * m)]
    return exchange_pb2.CandidateBlock(
        session_id="0123456789abcdef0123456789abcdef",  # a uuid4 hex
        position=1500,
        token_ids=ids[::m],
        q=exchange_pb2.SparseDistribution(width=m, ids=ids, probs=probs),
    )


def test_bytes_per_step_k4_m64():
    # A K=4 block with a 64-entry sparse q over a Qwen-sized vocabulary stays under 2 KB
    # (a full-vocabulary q would be 4 * 151936 * 4 bytes = 2.4 MB).
    from protos.specdec.v1 import exchange_pb2

    block = _block(4, 64)
    size = block.ByteSize()
    print(f"CandidateBlock K=4 M=64: {size} bytes")
    assert size == len(block.SerializeToString())
    assert size < 2048
    greedy = exchange_pb2.CandidateBlock(session_id="0" * 32, position=1500, token_ids=[151000] * 4)
    print(f"CandidateBlock K=4 greedy: {greedy.ByteSize()} bytes")
    assert greedy.ByteSize() < 64
    reply = exchange_pb2.VerificationResult(
        status=exchange_pb2.VERIFY_STATUS_OK, accepted=4, token_ids=[151000] * 5, committed_len=1505,
        target_time_s=0.0123,
    )
    print(f"VerificationResult n=4: {reply.ByteSize()} bytes")
    assert reply.ByteSize() < 64
