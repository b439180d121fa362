#!/usr/bin/env python
"""Render every overlay and validate it offline: schemas, then what specdec needs of it.

No Kubernetes API server is needed (none is reachable from CI):

1. ``kubectl kustomize k8s/overlays/<name>`` renders the overlay (kubectl has kustomize built in).
2. :func:`schema_check.validate_schemas` checks every object against its schema: the
   ``RayService`` against KubeRay's vendored CRD, core objects (and the pod templates and Serve
   Service embedded in the RayService) against Kubernetes, the ServiceMonitor against the
   fields we use (``k8s/schema_check.py``).
3. :func:`specdec_checks.check_specdec` checks the deployment against its AppConfig: Serve
   config, placement and resources, ports, readiness, the tenants Secret, the model cache,
   selectors, image (``k8s/specdec_checks.py``).
4. :func:`dashboard_check.check_dashboard`: the Grafana dashboard reads only metric names the code
   exports (``deployments/metrics.py``), each documented in ``k8s/README.md``.

Every check returns a list of error strings (empty: valid), so a test can break a rendered object
and assert that the validator notices.

    python k8s/validate.py               # all overlays
    python k8s/validate.py gpu           # one
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

K8S_DIR = Path(__file__).resolve().parent
if str(K8S_DIR) not in sys.path:
    sys.path.insert(0, str(K8S_DIR))

import render_serve_config as rsc  # noqa: E402  (adds the repository root to sys.path)
from schema_check import validate_schemas  # noqa: E402
from dashboard_check import check_dashboard  # noqa: E402
from specdec_checks import check_specdec  # noqa: E402


class KubectlMissing(RuntimeError):
    pass


# --- rendering ---------------------------------------------------------------------------------


def overlays() -> list[str]:
    """Overlay names (directories of k8s/overlays)."""
    return sorted(p.name for p in (K8S_DIR / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def kubectl() -> str:
    """Path of kubectl; raises KubectlMissing with what to do when it is not on PATH."""
    path = shutil.which("kubectl")
    if not path:
        raise KubectlMissing(
            "kubectl is not on PATH: the k8s manifests are rendered with `kubectl kustomize` "
            "(kustomize is built into kubectl >= 1.14). Install kubectl "
            "(https://kubernetes.io/docs/tasks/tools/) and rerun."
        )
    return path


def render_text(overlay: str) -> str:
    """``kubectl kustomize k8s/overlays/<overlay>`` (no cluster needed)."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(K8S_DIR / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize k8s/overlays/{overlay} failed:\n{proc.stderr}")
    return proc.stdout


def render(overlay: str) -> list[dict]:
    """The rendered objects of ``overlay``."""
    return [d for d in yaml.safe_load_all(render_text(overlay)) if d]


def validate_overlay(overlay: str, docs: list[dict] | None = None) -> list[str]:
    """All errors of ``overlay`` (rendered now unless ``docs`` is given)."""
    docs = render(overlay) if docs is None else docs
    errors = validate_schemas(docs)
    try:
        errors += check_specdec(overlay, docs)
    except Exception as e:  # a malformed object the schema step already reported, most likely
        errors.append(f"specdec checks could not run: {type(e).__name__}: {e}")
    return errors


def parse_overlay_names(argv: list[str]) -> list[str]:
    """The overlays the CLI arguments name (none: every overlay of ``k8s/overlays``).

    Raises:
        SystemExit: status 0 for ``--help``, status 2 (argparse's message listing the overlays)
            for a name that is not an overlay, before anything is rendered.
    """
    import argparse

    known = overlays()
    parser = argparse.ArgumentParser(
        prog="python k8s/validate.py",
        description="Render the k8s overlays with kubectl kustomize and validate them offline (KubeRay's "
                    "RayService CRD, Kubernetes schemas, specdec's own checks, the Grafana dashboard). "
                    "$KUBERAY_RAYSERVICE_CRD: another RayService CRD to check against.")
    parser.add_argument("overlay", nargs="*", metavar="OVERLAY",
                        help=f"overlay to validate: {', '.join(known)} (default: all)")
    names = parser.parse_args(argv).overlay
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"no overlay {', '.join(map(repr, unknown))} in k8s/overlays (overlays: {', '.join(known)})")
    return names or known


def main(argv: list[str] | None = None) -> int:
    """The CLI: validate the overlays named in ``argv`` (default: all; :func:`parse_overlay_names`);
    returns 0 when all are valid, else 1."""
    names = parse_overlay_names(sys.argv[1:] if argv is None else argv)
    bad = 0
    stale = rsc.stale_patches()
    if stale:
        print(f"stale serve-config.yaml in {stale}: run python k8s/render_serve_config.py", file=sys.stderr)
        bad += 1
    dash = check_dashboard()
    print(f"grafana dashboard: {'OK' if not dash else f'{len(dash)} error(s)'}")
    for e in dash:
        print(f"  - {e}")
    bad += bool(dash)
    for name in names:
        errors = validate_overlay(name)
        print(f"{name}: {'OK' if not errors else f'{len(errors)} error(s)'}")
        for e in errors:
            print(f"  - {e}")
        bad += bool(errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
