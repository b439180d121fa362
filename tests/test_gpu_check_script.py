"""``scripts/gpu-check.sh`` as written, checked without a GPU (no GPU has run it yet).

Every ``specdec`` command it runs is parsed by the real command line (a renamed flag or prompt
fails here, not on the GPU machine), every test path it names exists, and the demo pair it
prefetches is the weight formats its steps load: bfloat16 for ``specdec bench --device cuda``
(the default on CUDA), float32 for the tests (tests/conftest.py).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _command_lines() -> list[str]:
    """The script's lines with backslash continuations joined and comments dropped."""
    joined, lines = "", []
    for raw in SCRIPT.read_text().splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        lines.append((joined + line).strip())
        joined = ""
    return [line for line in lines if line]


def test_gpu_check_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_specdec_command_of_gpu_check_parses(monkeypatch, tmp_path):
    from benchmarks.inprocess_args import resolve_args
    from benchmarks.inprocess_prompts import select_prompts
    from specdec import cli
    from specdec.models.formats import default_format

    tests_format = os.environ["SPECDEC_WEIGHT_FORMAT"]  # what tests/conftest.py makes every test load
    monkeypatch.delenv("SPECDEC_WEIGHT_FORMAT")
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(cli, "run_prefetch", lambda args: calls.append(("prefetch", args)) or 0)
    real = cli.registered_commands()
    monkeypatch.setattr(cli, "registered_commands", lambda: {
        name: cli.Command(c.help, c.add_arguments, lambda args, name=name: calls.append((name, args)) or 0)
        for name, c in real.items()})
    specdec_lines = [line for line in _command_lines() if line.startswith("specdec ")]
    assert len(specdec_lines) >= 2, specdec_lines  # prefetch and the bench
    for line in specdec_lines:
        argv = shlex.split(line.replace("$OUT", str(tmp_path)))[1:]
        assert cli.main(argv) == 0, line
    prefetched = {args.weight_format for name, args in calls if name == "prefetch"}
    assert prefetched == {default_format("cuda"), tests_format} == {"bfloat16", "float32"}
    benches = [args for name, args in calls if name == "bench"]
    assert len(benches) == 1
    bench = resolve_args(benches[0])
    assert bench.device == "cuda" and bench.prompts and select_prompts(bench.prompts)
    assert bench.tokens == 64 and bench.ks == [2, 4, 8] and bench.hf == ["assisted"]


def test_gpu_check_test_paths_and_marker_exist():
    runs = [shlex.split(line) for line in _command_lines() if "-m pytest" in line]
    assert len(runs) == 2
    paths = [a for argv in runs for a in argv if a.startswith("tests/")]
    assert paths == ["tests/test_gpu.py", "tests/test_devices.py", "tests/deployments/test_tp_worker_device.py"]
    assert all((ROOT / p).is_file() for p in paths)
    assert '"gpu: needs a CUDA GPU' in (ROOT / "pyproject.toml").read_text()  # the marker -m gpu selects
    assert runs[0][runs[0].index("pytest") + 1:][-3:] == ["-m", "gpu", "tests/test_gpu.py"]
    assert "pytestmark = [pytest.mark.gpu" in (ROOT / "tests" / "test_gpu.py").read_text()
