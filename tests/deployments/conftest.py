"""Fixtures shared by the tests of the serving layer (helpers of the served tests: ``serving.py``)."""

from __future__ import annotations

import pytest

from specdec.testing.tiny import build_tiny_model
from tests.conftest import load_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """``(target folder, draft folder)``: a tiny pair, the draft the target's weights plus noise
    (it agrees often, not always), built once per module."""
    root = tmp_path_factory.mktemp("serve")
    target = build_tiny_model(root / "target", seed=0)
    draft = build_tiny_model(root / "draft", seed=1, base=load_tiny(target).model, noise=0.03)
    return str(target), str(draft)
