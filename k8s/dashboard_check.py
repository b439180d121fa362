"""The Grafana dashboard against the code: it reads only metrics that ``deployments/metrics.py``
exports, each documented in ``k8s/README.md``'s metric table, and every panel has a query.

``k8s/validate.py`` runs :func:`check_dashboard` after the manifest checks; it returns a list of
error strings (empty: valid), so a test can break the dashboard and assert that the check notices.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

K8S_DIR = Path(__file__).resolve().parent
ROOT = K8S_DIR.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: where the Grafana dashboard is
DASHBOARD = K8S_DIR / "grafana" / "specdec-dashboard.json"


def exported_metric_names() -> dict[str, str]:
    """The names Prometheus sees for every metric the code defines
    (:data:`deployments.metrics.METRICS`): ``"ray_" + name`` (+ ``"_total"`` for counters) ->
    kind. Histograms are also read through ``_bucket``, ``_sum`` and ``_count``."""
    from deployments.metrics import METRICS

    return {"ray_" + name + ("_total" if kind == "counter" else ""): kind for name, (kind, *_) in METRICS.items()}


def check_dashboard(dashboard: dict | None = None, readme: str | None = None) -> list[str]:
    """The Grafana dashboard reads only metrics the code exports, each documented in
    ``k8s/README.md``'s metric table, and every panel has a query.

    Args:
        dashboard: the dashboard JSON (default: :data:`DASHBOARD`).
        readme: the text of ``k8s/README.md`` (default: read from disk).

    Returns:
        error strings (empty: valid): a ``ray_specdec_*`` name no metric of
        :mod:`deployments.metrics` exports (with its panel), a histogram suffix on a
        non-histogram, a used metric missing from the README, a panel without targets.
    """
    if dashboard is None:
        dashboard = json.loads(DASHBOARD.read_text())
    if readme is None:
        readme = (K8S_DIR / "README.md").read_text()
    exported = exported_metric_names()
    errors: list[str] = []
    used: set[str] = set()
    for panel in dashboard.get("panels") or []:
        title = panel.get("title", "?")
        if not panel.get("targets"):
            errors.append(f"panel {title!r} has no query")
        for t in panel.get("targets") or []:
            for name in re.findall(r"\bray_specdec_[a-z_]+", t.get("expr", "")):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                if name in exported:
                    used.add(name)
                elif base != name and exported.get(base) == "histogram":
                    used.add(base)
                elif base in exported:
                    errors.append(f"panel {title!r}: {name} reads a {exported[base]} as a histogram")
                else:
                    errors.append(f"panel {title!r}: {name} is not a metric the code exports "
                                  "(deployments/metrics.py METRICS, with ray_ and _total for counters)")
    for name in sorted(used):
        if f"`{name}`" not in readme:
            errors.append(f"{name} is used by the dashboard but not documented in k8s/README.md")
    return errors
