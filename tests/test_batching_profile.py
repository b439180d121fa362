"""benchmarks.batching_profile: one K per client count (one client speculating, eight plain)."""

from __future__ import annotations

import json

import pytest


def test_batching_profile_takes_one_k_per_client_count(tiny_pair_folders, tmp_path):
    """``--clients 2,1 --k 0,3``: the 2-client group runs K = 0 (no draft forward), the one
    client K = 3 (draft forwards, blocks of 3)."""
    from benchmarks.batching_profile import main

    target, draft = tiny_pair_folders
    out = tmp_path / "prof"
    assert main(["--target", str(target), "--draft", str(draft), "--format", "int8", "--clients", "2,1",
                 "--k", "0,3", "--max-tokens", "6", "--threads", "1", "--out", str(out)]) == 0
    groups = json.loads((out / "profile-1t-6tok.json").read_text())["groups"]
    assert [(g["clients"], g["k"], g["tokens"]) for g in groups] == [(2, 0, 12), (1, 3, 6)]
    assert "draft decode" not in groups[0]["parts"] and groups[1]["parts"]["draft decode"]["calls"] > 0


@pytest.mark.parametrize("k", ["1,2,3", "a"])
def test_batching_profile_refuses_a_k_list_that_does_not_fit(k):
    from benchmarks.batching_profile import main

    with pytest.raises(SystemExit) as e:
        main(["--clients", "1,8", "--k", k])
    assert e.value.code == 2
