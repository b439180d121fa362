"""The processes that hold no model do not import torch: the router (ingress) replica and the
target replica (its TP ranks hold the model). Each would otherwise carry torch and transformers'
model code, about 0.2-0.3 GiB of RSS (docs/bench/served-w8a8/README.md, "Served w8a8 after ...").

Checked here in a fresh interpreter without Ray: a Router built as its replica builds it (its
target info read in a child process), admitting and tokenizing a request, and the target
replica's folder lookup; served, ``test_serve_grpc.py::test_router_and_target_replicas_hold_no_torch``
checks the live replicas' memory maps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.isolated import call_in_child
from specdec.control.tenants import hash_api_key

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-lean-imports-key"

_ROUTER = r"""
import asyncio, json, sys
from deployments.config import AppConfig
from deployments.controller_client import ControllerClient
from deployments.metrics import SpecDecMetrics
from deployments.router import Router
from deployments.tenancy import TenancyGate

folder, tenants, key = sys.argv[1:4]
cfg = AppConfig(target_model=folder, draft_model=None, tenants_file=tenants)
r = Router(cfg, gate=TenancyGate(cfg.tenants_file, ControllerClient.local(), SpecDecMetrics(backend=None)))
r.__serve_build_asgi_app__()  # the OpenAI API of the replica
job, _, adm = asyncio.run(r._prepare({"prompt": "def add(a, b):", "max_tokens": 4}, {"authorization": f"Bearer {key}"}))
print(json.dumps({"ids": list(job.request.prompt_token_ids.ids), "max_positions": r.info.max_positions,
                  "eos": list(r.info.eos_token_ids), "tokenizer": type(r.info.tokenizer).__name__,
                  "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("transformers.modeling"))}))
"""

_TARGET = r"""
import json, sys
import deployments.target
from deployments.config import AppConfig
from deployments.target_info import target_folder

cfg = AppConfig(target_model=sys.argv[1], draft_model=None, target_dtype="float32")
folder, fmt = target_folder(cfg)
print(json.dumps({"folder": folder, "format": fmt, "torch": "torch" in sys.modules}))
"""


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_router_tokenizes_and_admits_without_torch(tiny_model_folder, tmp_path):
    from deployments.target_info import TargetInfo

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - id: acme\n    api_key_hashes: [{hash_api_key(KEY)}]\n")
    got = _run(_ROUTER, str(tiny_model_folder), str(tenants), KEY)
    alone = TargetInfo.load(str(tiny_model_folder))  # in this process: AutoTokenizer, with torch
    assert got == {"ids": alone.tokenizer.encode("def add(a, b):"), "max_positions": alone.max_positions,
                   "eos": list(alone.eos_token_ids), "tokenizer": type(alone.tokenizer).__name__, "torch": []}
    assert len(got["ids"]) > 3 and got["max_positions"] == 256


def test_target_replica_finds_its_folder_without_torch(tiny_model_folder):
    assert _run(_TARGET, str(tiny_model_folder)) == {"folder": str(tiny_model_folder), "format": "float32",
                                                     "torch": False}


def test_call_in_child_returns_the_value_and_raises_the_error():
    assert call_in_child(os.getpid) != os.getpid()
    assert call_in_child(sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"^invalid literal for int\(\) with base 10: 'x'$"):
        call_in_child(int, "x")
