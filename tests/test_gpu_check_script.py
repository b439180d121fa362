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

import pytest

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


def _argv(line: str, tmp_path: Path) -> list[str]:
    """A command line's words without a leading ``timeout "$T"`` or a trailing ``|| echo ...``,
    the script's variables replaced (the demo pair's specs, the full size's settings, ``$OUT`` by ``tmp_path``)."""
    line = line.split(" || ")[0]
    for var, value in (("$OUT", str(tmp_path)), ("$TARGET", "demo:target"), ("$FAR_DRAFT", "demo:draft"),
                       ("$DRAFT", "demo:draft"), ("$PROMPTS", "code-prime,poem-sea"), ("$BTOKENS", "64"),
                       ("$TOKENS", "64"), ("$KS", "2,4,8"), ("$REPEATS", "2"), ("$CLIENTS", "1,2,4,8")):
        line = line.replace(var, value)
    argv = shlex.split(line)
    return argv[2:] if argv[0] == "timeout" else argv


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
    specdec_lines = [_argv(line, tmp_path) for line in _command_lines()
                     if line.startswith(("specdec ", 'timeout "$T" specdec '))]
    assert len(specdec_lines) == 4, specdec_lines  # two prefetches, the bench, the unrelated draft's bench
    for argv in specdec_lines:
        assert cli.main(argv[1:]) == 0, argv
    prefetched = {args.weight_format for name, args in calls if name == "prefetch"}
    assert prefetched == {default_format("cuda"), tests_format} == {"bfloat16", "float32"}
    benches = [args for name, args in calls if name == "bench"]
    assert len(benches) == 2
    bench = resolve_args(benches[0])
    assert bench.device == "cuda" and bench.prompts and select_prompts(bench.prompts)
    assert bench.tokens == 64 and bench.ks == [2, 4, 8] and bench.hf == ["assisted"]


def test_gpu_check_test_paths_and_marker_exist(tmp_path):
    runs = [_argv(line, tmp_path) for line in _command_lines() if "-m pytest" in line]
    assert len(runs) == 3
    paths = [a for argv in runs for a in argv if a.startswith("tests/")]
    assert paths[:4] == ["tests/test_gpu.py", "tests/test_gpu_batch.py", "tests/test_devices.py",
                         "tests/deployments/test_tp_worker_device.py"]
    assert "tests/test_batch.py" in paths[4:] and runs[2][0] == "SPECDEC_TEST_DEVICE=cuda"
    assert all((ROOT / p).is_file() for p in paths)
    assert '"gpu: needs a CUDA GPU' in (ROOT / "pyproject.toml").read_text()  # the marker -m gpu selects
    assert runs[0][-4:] == ["-m", "$MARK", "tests/test_gpu.py", "tests/test_gpu_batch.py"]
    assert "pytestmark = [pytest.mark.gpu" in (ROOT / "tests" / "test_gpu.py").read_text()
    assert "pytestmark = pytest.mark.gpu" in (ROOT / "tests" / "test_gpu_batch.py").read_text()


def test_gpu_check_benchmark_commands_parse(tmp_path, monkeypatch):
    """Every ``python -m benchmarks.X`` line of the script parses with that module's own parser."""
    import argparse
    import importlib

    lines = [_argv(line, tmp_path) for line in _command_lines() if line.split(" || ")[0].find("-m benchmarks.") >= 0]
    assert [argv[2] for argv in lines] == ["benchmarks.random_pair", "benchmarks.forward_costs", "benchmarks.batching"]
    for argv in lines:
        parsed = {}

        def stop(self, args=None, namespace=None):
            parsed["args"] = argparse.ArgumentParser.parse_known_args(self, args, namespace)
            raise SystemExit(0)

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
        words = [w.replace("${GPU_CHECK_META:-.gpu/demo-meta}", ".gpu/demo-meta")
                 .replace("${GPU_CHECK_DAMP:-0.02}", "0.02").replace("$PAIR", str(tmp_path)) for w in argv[3:]]
        try:
            importlib.import_module(argv[2]).main(words)
        except SystemExit:
            pass
        args, unknown = parsed["args"]
        assert unknown == [], (argv[2], unknown)
        assert getattr(args, "device", None) == "cuda", argv


def test_random_pair_refuses_a_meta_folder_without_configs_and_a_bad_prefix(tmp_path, capsys):
    """benchmarks.random_pair's bad input: a --meta without the pair's configs, and a prefix of no
    layers or of all of them, end in a usage error (exit 2) that names the fix, before any weights."""
    import json

    import pytest

    from benchmarks import random_pair

    with pytest.raises(SystemExit) as e:
        random_pair.main(["--meta", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "needs target/config.json and draft/config.json" in capsys.readouterr().err
    for role in ("target", "draft"):
        (tmp_path / "meta" / role).mkdir(parents=True)
        (tmp_path / "meta" / role / "config.json").write_text(json.dumps(
            {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16,
             "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32}))
    for bad in ("0", "2"):
        with pytest.raises(SystemExit) as e:
            random_pair.main(["--meta", str(tmp_path / "meta"), "--out", str(tmp_path / "out"), "--prefix-layers", bad])
        assert e.value.code == 2 and f"--prefix-layers {bad} must be in 1..1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("env, message", [
    ({"GPU_CHECK_IMPORT_TIMEOUT": "abc"}, "GPU_CHECK_IMPORT_TIMEOUT=abc: expected whole seconds above 0"),
    ({"GPU_CHECK_IMPORT_TIMEOUT": "-5"}, "GPU_CHECK_IMPORT_TIMEOUT=-5: expected whole seconds above 0"),
    ({"GPU_CHECK_TEST_TIMEOUT": ""}, "GPU_CHECK_TEST_TIMEOUT=: expected whole seconds above 0"),
    ({"GPU_CHECK_TEST_TIMEOUT": "0"}, "GPU_CHECK_TEST_TIMEOUT=0: expected whole seconds above 0"),
    ({"GPU_CHECK_SIZE": "shrt"}, "GPU_CHECK_SIZE=shrt: expected short or full"),
])
def test_gpu_check_refuses_bad_settings_before_doing_anything(env, message, tmp_path):
    """A bad time limit or size ends the script at once (exit 2, the setting named), before it
    writes its log or looks for a GPU."""
    import shutil

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "gpu-check.sh")
    run = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=repo, capture_output=True, text=True, timeout=30,
                         env={**os.environ, **env})
    assert run.returncode == 2
    assert run.stderr.strip() == f"gpu-check: {message}"
    assert not (repo / "docs").exists()
