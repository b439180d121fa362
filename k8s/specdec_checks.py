"""What specdec needs of a rendered overlay, checked against the overlay's AppConfig.

:func:`check_specdec` checks the deployment against its AppConfig
(``k8s/render_serve_config.py``): serveConfigV2 equal to the Serve config of the profile and,
apart from :data:`K8S_OVERRIDES`, to the committed ``deployments/*.yaml`` (and valid for Ray
Serve's own schema); worker-group capacity and pool pinning (:mod:`capacity_checks`); head ``num-cpus: "0"``; container port names; every Ray container's
``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`` (``deployments.cli.GRPC_MAX_MESSAGE_BYTES``); readiness on Serve's ``/-/healthz``; the
tenants Secret mounted where the router reads it and holding only hashes; the model cache;
Services, monitors and budgets whose selectors match the pods; one tagged image.

Schema validity is :mod:`schema_check`'s job; ``k8s/validate.py`` runs both. Every check returns
a list of error strings (empty: valid), so a test can break a rendered object and assert that
the check notices.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

K8S_DIR = Path(__file__).resolve().parent
if str(K8S_DIR) not in sys.path:
    sys.path.insert(0, str(K8S_DIR))

import render_serve_config as rsc  # noqa: E402  (adds the repository root to sys.path)
from render_serve_config import (  # noqa: E402
    K8S_OVERRIDES,
    MODEL_CACHE_DIR,
    OVERLAY_PRESETS,
    TENANTS_FILE,
)
from capacity_checks import GPU, check_capacity, limit_of, parse_quantity, ray_container  # noqa: E402
from schema_check import pod_templates  # noqa: E402

from deployments.cli import GRPC_MAX_MESSAGE_BYTES  # noqa: E402  (what `specdec serve` sets)

#: Container ports every Ray node declares (name -> port); the head also has gcs-server and dashboard.
WORKER_PORTS = {"serve": 8000, "serve-grpc": 9000, "metrics": 8080}
HEAD_PORTS = {**WORKER_PORTS, "gcs-server": 6379, "dashboard": 8265}
#: Kinds every overlay must render (the ServiceMonitor only where the Prometheus Operator is used).
REQUIRED_KINDS = {"RayService", "Secret", "Service", "PersistentVolumeClaim", "PodDisruptionBudget"}
#: Shape of generate_api_key() (specdec/control/tenants.py): a plaintext key must never be rendered.
PLAINTEXT_KEY = re.compile(r"sk-[A-Za-z0-9_-]{20,}")


def _labels_of(template: dict, node_type: str, group: str) -> dict:
    """Labels the pod will carry: the template's plus those KubeRay adds."""
    labels = dict(((template.get("metadata") or {}).get("labels")) or {})
    labels.update({"ray.io/node-type": node_type, "ray.io/group": group})
    if node_type == "worker":  # KubeRay marks pods whose Serve proxy is healthy
        labels["ray.io/serve"] = "true"
    return labels


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def _demo_roles(cfg) -> set[str]:
    return {m.split(":", 1)[1] or "target" for m in (cfg.target_model, cfg.draft_model) if m and m.startswith("demo")}


def _compare_to_local(serve: dict, local: dict) -> list[str]:
    """Differences between the rendered Serve config and the committed local file, ignoring
    only the args in K8S_OVERRIDES."""
    a, b = copy.deepcopy(serve), copy.deepcopy(local)
    pins = {k for d in rsc.OVERLAY_OVERRIDES.values() for field in d.values() for k in field}
    for cfg in (a, b):
        for app in cfg.get("applications", []):
            for key in (*K8S_OVERRIDES, *rsc.PINNING_FIELDS):
                (app.get("args") or {}).pop(key, None)
            for dep in app.get("deployments", []):  # the pool pinning resources only
                (dep.get("ray_actor_options") or {}).pop("resources", None)
                for bundle in dep.get("placement_group_bundles") or []:
                    for key in pins:
                        bundle.pop(key, None)
    if a == b:
        return []
    diffs = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            diffs.append(key)
    return [f"serveConfigV2 differs from the local Serve config beyond {sorted(K8S_OVERRIDES)} in: {', '.join(diffs)}"]


def check_specdec(overlay: str, docs: list[dict]) -> list[str]:
    """What specdec needs of a rendered overlay, checked against the overlay's AppConfig."""
    from deployments.write_configs import HERE as DEPLOYMENTS_DIR

    cfg = rsc.profile(overlay)
    errors: list[str] = []
    kinds = {d.get("kind") for d in docs}
    if missing := REQUIRED_KINDS - kinds:
        errors.append(f"missing objects: {sorted(missing)}")
    rss = [d for d in docs if d.get("kind") == "RayService"]
    if len(rss) != 1:
        return errors + [f"expected one RayService, got {len(rss)}"]
    rs = rss[0]
    spec = rs.get("spec") or {}
    rc = spec.get("rayClusterConfig") or {}

    # Serve config: generated from the AppConfig, equal to the local preset apart from overrides.
    text = spec.get("serveConfigV2")
    if not isinstance(text, str):
        errors.append("spec.serveConfigV2 is missing (the overlay must patch in serve-config.yaml)")
        serve = None
    else:
        serve = yaml.safe_load(text)
        if serve != rsc.serve_config(overlay):
            errors.append(f"spec.serveConfigV2 is not the Serve config of AppConfig profile {overlay!r} "
                          "(run python k8s/render_serve_config.py)")
        local = yaml.safe_load((DEPLOYMENTS_DIR / OVERLAY_PRESETS[overlay]).read_text())
        errors += _compare_to_local(serve, local)
        try:
            from ray.serve.config import AutoscalingConfig
            from ray.serve.schema import ServeDeploySchema

            ServeDeploySchema.model_validate(serve)
            for app in serve.get("applications", []):
                for dep in app.get("deployments", []):
                    if "autoscaling_config" in dep:
                        AutoscalingConfig(**dep["autoscaling_config"])
        except Exception as e:  # pydantic or ValueError: report, don't crash
            errors.append(f"serveConfigV2 fails Ray Serve's schema: {e}")
        if serve.get("grpc_options", {}).get("port") != WORKER_PORTS["serve-grpc"]:
            errors.append("serveConfigV2 grpc port is not the serve-grpc container port 9000")
        if serve.get("http_options", {}).get("port") != WORKER_PORTS["serve"]:
            errors.append("serveConfigV2 http port is not the serve container port 8000 (readiness uses it)")
        if serve.get("proxy_location") not in (None, "EveryNode"):
            errors.append("serveConfigV2 proxy_location must be EveryNode (workers' readiness needs their proxy)")

    # Autoscaling.
    if rc.get("enableInTreeAutoscaling") is not True:
        errors.append("rayClusterConfig.enableInTreeAutoscaling must be true")

    # Head: no replicas, no GPU, all ports.
    head = rc.get("headGroupSpec") or {}
    if (head.get("rayStartParams") or {}).get("num-cpus") != "0":
        errors.append('headGroupSpec.rayStartParams.num-cpus must be "0" (no replica on the head)')
    head_c = ray_container(head.get("template") or {})
    if limit_of(head_c, GPU):
        errors.append("the head must not request GPUs")
    errors += _check_ports("head", head_c, HEAD_PORTS)
    errors += _check_grpc_cap("head", head_c)

    groups = rc.get("workerGroupSpecs") or []
    if not groups:
        errors.append("no workerGroupSpecs")
    by_name = {g.get("groupName"): g for g in groups}

    # Per worker group: ports, readiness, replicas, GPU scheduling, mounts.
    tenants_dir, tenants_key = os.path.dirname(cfg.tenants_file or TENANTS_FILE), os.path.basename(cfg.tenants_file or TENANTS_FILE)
    for g in groups:
        name = g.get("groupName")
        tmpl = g.get("template") or {}
        pod = tmpl.get("spec") or {}
        c = ray_container(tmpl)
        errors += _check_ports(f"workerGroup {name}", c, WORKER_PORTS)
        errors += _check_grpc_cap(f"workerGroup {name}", c)
        probe = (c.get("readinessProbe") or {}).get("httpGet") or {}
        if probe.get("path") != "/-/healthz" or probe.get("port") not in (8000, "serve"):
            errors.append(f"workerGroup {name}: readinessProbe must be httpGet /-/healthz on port 8000 (Serve's health)")
        lo, n, hi = g.get("minReplicas", 0), g.get("replicas", g.get("minReplicas", 0)), g.get("maxReplicas", 0)
        if not lo <= n <= hi or hi < 1:
            errors.append(f"workerGroup {name}: need minReplicas <= replicas <= maxReplicas, maxReplicas >= 1")
        for key in ("cpu", "memory", GPU):
            req = ((c.get("resources") or {}).get("requests") or {}).get(key)
            lim = ((c.get("resources") or {}).get("limits") or {}).get(key)
            if key != GPU and lim is None:
                errors.append(f"workerGroup {name}: no {key} limit (Ray counts its resources from limits)")
            if key == GPU and (req is not None or lim is not None) and (req is None or lim is None or parse_quantity(req) != parse_quantity(lim)):
                errors.append(f"workerGroup {name}: {GPU} requests must equal limits")
        if limit_of(c, GPU):
            tol = pod.get("tolerations") or []
            if not any(t.get("key") == GPU for t in tol):
                errors.append(f"workerGroup {name}: GPU pods need a toleration for the {GPU} taint")
            if not pod.get("nodeSelector") and not pod.get("affinity"):
                errors.append(f"workerGroup {name}: GPU pods need a nodeSelector (or affinity) for their node pool")
            if limit_of(c, GPU) != int(limit_of(c, GPU)):
                errors.append(f"workerGroup {name}: {GPU} must be a whole number")
        errors += _check_mounts(f"workerGroup {name}", tmpl, docs, tenants_dir, tenants_key, cfg)
    errors += _check_mounts("head", head.get("template") or {}, docs, tenants_dir, tenants_key, cfg, models=False)

    # GPUs per group match the AppConfig.
    errors += check_capacity(cfg, by_name)

    # Secret: tenants hashes only.
    errors += _check_tenants_secret(docs, tenants_key)

    # Services, monitors and budgets select the pods they mean.
    pods = [("head", _labels_of(head.get("template") or {}, "head", "headgroup"))] + [
        (g.get("groupName"), _labels_of(g.get("template") or {}, "worker", g.get("groupName"))) for g in groups
    ]
    errors += _check_selectors(spec, docs, pods)

    # Images: one image everywhere, not the bare placeholder.
    images = {c.get("image") for _, t in pod_templates(rs)
              for c in ((t.get("spec") or {}).get("containers") or []) + ((t.get("spec") or {}).get("initContainers") or [])}
    if len(images) != 1:
        errors.append(f"all Ray containers should run the same image, got {sorted(map(str, images))}")
    elif not all(i and ":" in i.rsplit("/", 1)[-1] for i in images):
        errors.append(f"image {images} has no tag (set one with kustomize edit set image specdec=REGISTRY/specdec:TAG)")
    return errors


def _check_ports(where: str, container: dict, want: dict[str, int]) -> list[str]:
    have = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    return [f"{where}: container port {name!r} must be {port} (has {have.get(name)})"
            for name, port in want.items() if have.get(name) != port]


def _check_grpc_cap(where: str, container: dict) -> list[str]:
    """The Ray container's env caps its node's Serve gRPC proxy at GRPC_MAX_MESSAGE_BYTES (bytes, as a
    decimal string): proxies run on every node, and Serve's default (2 GiB) is read and parsed before
    a request is authenticated."""
    env = {e.get("name"): e.get("value") for e in container.get("env") or []}
    if env.get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE") != str(GRPC_MAX_MESSAGE_BYTES):
        return [f"{where}: env RAY_SERVE_GRPC_MAX_MESSAGE_SIZE must be \"{GRPC_MAX_MESSAGE_BYTES}\" "
                f"(deployments/cli.py GRPC_MAX_MESSAGE_BYTES; has {env.get('RAY_SERVE_GRPC_MAX_MESSAGE_SIZE')!r})"]
    return []


def _volume_sources(pod: dict) -> dict[str, dict]:
    return {v.get("name"): v for v in pod.get("volumes") or []}


def _check_mounts(where, tmpl, docs, tenants_dir, tenants_key, cfg, models=True) -> list[str]:
    errors = []
    pod = tmpl.get("spec") or {}
    c = ray_container(tmpl)
    vols = _volume_sources(pod)
    secret_names = {d["metadata"]["name"] for d in docs if d.get("kind") == "Secret"}
    pvc_names = {d["metadata"]["name"] for d in docs if d.get("kind") == "PersistentVolumeClaim"}

    def mount_of(container, path):
        return next((m for m in container.get("volumeMounts") or [] if m.get("mountPath") == path), None)

    m = mount_of(c, tenants_dir)
    src = vols.get(m.get("name")) if m else None
    if not m or not src or "secret" not in src:
        errors.append(f"{where}: the tenants Secret must be mounted at {tenants_dir} (AppConfig.tenants_file)")
    else:
        if src["secret"].get("secretName") not in secret_names:
            errors.append(f"{where}: volume {m.get('name')} refers to Secret {src['secret'].get('secretName')!r}, not rendered")
        items = src["secret"].get("items")
        if items and not any(i.get("path") == tenants_key for i in items):
            errors.append(f"{where}: the tenants Secret volume does not project {tenants_key}")
    if not models:
        return errors
    env = {e.get("name"): e.get("value") for e in c.get("env") or []}
    if env.get("SPECDEC_CACHE") != MODEL_CACHE_DIR:
        errors.append(f"{where}: env SPECDEC_CACHE must be {MODEL_CACHE_DIR}")
    m = mount_of(c, MODEL_CACHE_DIR)
    src = vols.get(m.get("name")) if m else None
    if not m or not src or "persistentVolumeClaim" not in src:
        errors.append(f"{where}: the model cache PVC must be mounted at {MODEL_CACHE_DIR}")
    elif src["persistentVolumeClaim"].get("claimName") not in pvc_names:
        errors.append(f"{where}: claim {src['persistentVolumeClaim'].get('claimName')!r} is not rendered")
    roles = _demo_roles(cfg)
    if roles:
        inits = pod.get("initContainers") or []
        words = [str(w) for i in inits for w in (i.get("command") or []) + (i.get("args") or [])]
        text = " ".join(words)
        init_env_ok = any({e.get("name"): e.get("value") for e in i.get("env") or []}.get("SPECDEC_CACHE") == MODEL_CACHE_DIR
                          and mount_of(i, MODEL_CACHE_DIR) for i in inits)
        if "specdec prefetch" not in text or not all(r in words for r in roles) or not init_env_ok:
            errors.append(f"{where}: an init container must assemble the demo models {sorted(roles)} into {MODEL_CACHE_DIR}")
        want = _loaded_format(cfg, limit_of(c, GPU) > 0)
        got = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--format"), None)
        if want != "mixed" and got != want:
            errors.append(f"{where}: the init container prefetches {got or 'the node CPU default format'} but the pod's "
                          f"models load {want or 'the node CPU default format'}: "
                          + (f"add --format {want} to its specdec prefetch" if want else "drop its --format"))
    return errors


def _loaded_format(cfg, gpu: bool) -> str | None:
    """The weight format a pod's demo models load: ``target_dtype`` / ``draft_dtype``, else the
    device's default (bfloat16 on a GPU pod: ``default_format("cuda")``; None on a CPU pod: the
    node CPU's own, which a ``specdec prefetch`` without ``--format`` builds); ``"mixed"`` when
    draft and target load different formats (one prefetch builds one)."""
    default = "bfloat16" if gpu else None
    formats = {cfg.target_dtype or default} | ({cfg.draft_dtype or default} if cfg.draft_model else set())
    return formats.pop() if len(formats) == 1 else "mixed"


def _strings(node: Any) -> Iterable[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def _check_tenants_secret(docs: list[dict], tenants_key: str) -> list[str]:
    from specdec.control.tenants import TenantConfigError, parse_tenants_config

    errors = []
    secrets = [d for d in docs if d.get("kind") == "Secret" and d["metadata"]["name"].startswith("specdec-tenants")]
    if len(secrets) != 1:
        return [f"expected one specdec-tenants Secret, got {len(secrets)}"]
    s = secrets[0]
    files = {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (s.get("data") or {}).items()}
    files.update(s.get("stringData") or {})
    if tenants_key not in files:
        return [f"Secret {s['metadata']['name']} has no key {tenants_key!r}"]
    for key, text in files.items():
        if PLAINTEXT_KEY.search(text):
            errors.append(f"Secret {s['metadata']['name']}/{key} holds something shaped like a plaintext API key")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            errors.append(f"Secret {s['metadata']['name']}/{key} is not YAML: {e}")
            continue
        if isinstance(data, dict) and any(re.fullmatch(r"api_?keys?", k, re.I) for k in _strings(data)):
            errors.append(f"Secret {s['metadata']['name']}/{key} has an api_key field: store sha256 hashes only")
    try:
        parse_tenants_config(files[tenants_key], source=f"Secret {s['metadata']['name']}/{tenants_key}")
    except (TenantConfigError, ValueError) as e:
        errors.append(str(e))
    for d in docs:  # a key must not hide anywhere else either (ConfigMaps, env, args, ...)
        if d is not s and any(PLAINTEXT_KEY.search(t) for t in _strings(d)):
            errors.append(f"{d.get('kind')} {d['metadata'].get('name')} holds something shaped like a plaintext API key")
    return errors


def _check_selectors(spec: dict, docs: list[dict], pods: list[tuple[str, dict]]) -> list[str]:
    errors = []
    svc = spec.get("serveService")
    if not svc:
        errors.append("spec.serveService (the Service exposing gRPC) is missing")
    else:
        ports = {p.get("name"): p for p in (svc.get("spec") or {}).get("ports") or []}
        if (ports.get("serve") or {}).get("port") != 8000:
            errors.append("spec.serveService must expose port 'serve' 8000")
        if set(ports) - {"serve"}:
            errors.append(f"spec.serveService ports {sorted(set(ports) - {'serve'})} are dropped by KubeRay "
                          "before kuberay#4558 (only 'serve' is kept): expose them with a Service of your own")
    services = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Service"}
    workers = [(n, labels) for n, labels in pods if labels.get("ray.io/node-type") == "worker"]
    grpc_svcs = [s for s in services.values()
                 if any(p.get("name") == "serve-grpc" for p in s["spec"].get("ports") or [])]
    if not grpc_svcs:
        errors.append("no Service exposes the gRPC port 'serve-grpc' 9000")
    for g in grpc_svcs:
        port = next(p for p in g["spec"]["ports"] if p.get("name") == "serve-grpc")
        if port.get("port") != 9000 or port.get("targetPort") not in (9000, "serve-grpc"):
            errors.append(f"Service {g['metadata']['name']}: 'serve-grpc' must be port 9000 to the serve-grpc container port")
        sel = g["spec"].get("selector") or {}
        missed = [n for n, labels in workers if not _matches(sel, labels)]
        if not sel or missed or any(_matches(sel, labels) for n, labels in pods if (n, labels) not in workers):
            errors.append(f"Service {g['metadata']['name']} must select every worker pod (and no head): missed {missed}")
    metrics = [d for d in services.values() if any(p.get("name") == "metrics" for p in d["spec"].get("ports") or [])]
    if not metrics:
        errors.append("no Service exposes the metrics port")
    for m in metrics:
        sel = m["spec"].get("selector") or {}
        missed = [n for n, labels in pods if not _matches(sel, labels)]
        if not sel or missed:
            errors.append(f"Service {m['metadata']['name']} does not select the pods of {missed or 'any group'}")
        if (next(p for p in m["spec"]["ports"] if p.get("name") == "metrics")).get("port") != 8080:
            errors.append(f"Service {m['metadata']['name']}: metrics port must be 8080")
    for sm in (d for d in docs if d.get("kind") == "ServiceMonitor"):
        sel = ((sm.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        targets = [s for s in services.values() if _matches(sel, s["metadata"].get("labels") or {})]
        if not sel or not targets:
            errors.append(f"ServiceMonitor {sm['metadata']['name']} selects no rendered Service")
        for ep in (sm.get("spec") or {}).get("endpoints") or []:
            if not any(p.get("name") == ep.get("port") for s in targets for p in s["spec"].get("ports") or []):
                errors.append(f"ServiceMonitor {sm['metadata']['name']}: endpoint port {ep.get('port')!r} not on its Services")
    for pdb in (d for d in docs if d.get("kind") == "PodDisruptionBudget"):
        sel = ((pdb.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        if not sel or not any(_matches(sel, labels) for _, labels in pods):
            errors.append(f"PodDisruptionBudget {pdb['metadata']['name']} selects no Ray pod")
    for _, labels in pods:
        if labels.get("app.kubernetes.io/name") == "kuberay":
            errors.append("pod label app.kubernetes.io/name is overwritten by KubeRay; select on part-of")
    return errors
