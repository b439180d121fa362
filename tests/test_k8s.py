"""k8s/: every overlay renders (kubectl kustomize) and validates offline, and stays in step with
the AppConfig that deployments/ uses. A deliberately broken manifest must fail.

Needs ``kubectl`` on PATH (on every machine of this kind); fails, never skips, without it.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"


def _load(path: Path, name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


val = _load(K8S / "validate.py", "specdec_k8s_validate")  # rendering, validate_overlay (the CLI)
# The modules validate.py imports, under the names it imports them by (one copy each):
schemas = _load(K8S / "schema_check.py", "schema_check")  # generic schema validation
checks = _load(K8S / "specdec_checks.py", "specdec_checks")  # what specdec needs of its manifests
capacity = _load(K8S / "capacity_checks.py", "capacity_checks")  # worker groups: GPUs, CPUs, pinning
dashboard = _load(K8S / "dashboard_check.py", "dashboard_check")  # the Grafana dashboard against the metrics
rsc = val.rsc  # the render_serve_config module validate.py uses (one copy)

OVERLAYS = sorted(rsc.OVERLAY_PRESETS)
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    try:
        val.kubectl()
    except val.KubectlMissing as e:
        pytest.fail(str(e))
    return {o: val.render(o) for o in OVERLAYS}


def _rayservice(docs):
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    return rs


def _groups(docs):
    return {g["groupName"]: g for g in _rayservice(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _container(group_or_head):
    return group_or_head["template"]["spec"]["containers"][0]


# --- rendering and schemas ---------------------------------------------------------------------


def test_every_overlay_directory_has_a_profile():
    assert set(val.overlays()) == set(OVERLAYS), "add the overlay to OVERLAY_PRESETS in k8s/render_serve_config.py"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(rendered, overlay):
    docs = rendered[overlay]
    kinds = sorted(d["kind"] for d in docs)
    assert checks.REQUIRED_KINDS <= set(kinds), kinds
    assert val.validate_overlay(overlay, docs) == []


def test_gpu_overlay_has_servicemonitor_and_it_selects_metrics(rendered):
    (sm,) = [d for d in rendered["gpu"] if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert schemas.validate_servicemonitor(sm) == []
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"


def test_serve_config_patches_are_up_to_date():
    assert rsc.stale_patches() == [], "run python k8s/render_serve_config.py"
    assert subprocess.run([sys.executable, str(K8S / "render_serve_config.py"), "--check"]).returncode == 0


def test_patch_drift_is_detected(monkeypatch, rendered):
    """Changing the AppConfig preset without regenerating must fail (patches and rendered checks)."""
    from deployments.config import PRESETS

    monkeypatch.setitem(PRESETS, "gpu.yaml", PRESETS["gpu.yaml"].model_copy(update={"target_tp": 4}))
    assert rsc.stale_patches() == ["gpu"]
    errors = checks.check_specdec("gpu", rendered["gpu"])
    assert any("not the Serve config of AppConfig profile 'gpu'" in e for e in errors), errors
    assert any("target_tp x target_gpus_per_worker = 4 x 1" in e for e in errors), errors


# --- the Serve config is the AppConfig's --------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_equals_local_serve_config(rendered, overlay):
    from deployments.config import to_serve_config
    from deployments.write_configs import HERE

    serve = yaml.safe_load(_rayservice(rendered[overlay])["spec"]["serveConfigV2"])
    assert serve == to_serve_config(rsc.profile(overlay))
    local = yaml.safe_load((HERE / rsc.OVERLAY_PRESETS[overlay]).read_text())
    (app,), (local_app,) = serve["applications"], local["applications"]
    # same deployments, same options, apart from the resources that pin them to their node pools
    pins = rsc.OVERLAY_OVERRIDES[overlay]
    expected = copy.deepcopy(local_app["deployments"])
    for dep in expected:
        res = pins.get({"Router": "router_resources", "Draft": "draft_resources"}.get(dep["name"], ""), {})
        if res:
            dep["ray_actor_options"]["resources"] = res
        if dep["name"] == "Target" and pins.get("target_resources"):
            dep["placement_group_bundles"][0].update(pins["target_resources"])
    assert app["deployments"] == expected
    assert {k: v for k, v in serve.items() if k != "applications"} == {k: v for k, v in local.items() if k != "applications"}
    assert ({k: v for k, v in app.items() if k not in ("args", "deployments")}
            == {k: v for k, v in local_app.items() if k not in ("args", "deployments")})
    # args: only the Kubernetes overrides and the pinning differ
    differing = {k for k in app["args"] if app["args"][k] != local_app["args"].get(k)}
    assert differing == set(rsc.K8S_OVERRIDES) | set(pins)
    assert app["args"]["tenants_file"] == rsc.TENANTS_FILE


def test_cpu_dev_serves_local_cpu_preset(rendered):
    serve = yaml.safe_load(_rayservice(rendered["cpu-dev"])["spec"]["serveConfigV2"])
    args = serve["applications"][0]["args"]
    assert args["target_model"] == "demo:target" and args["draft_model"] == "demo:draft"
    assert args["target_gpus_per_worker"] == 0 and args["draft_num_gpus"] == 0


# --- hardware shape ------------------------------------------------------------------------------


def test_gpu_counts_match_tensor_parallel_degree(rendered):
    cfg = rsc.profile("gpu")
    groups = _groups(rendered["gpu"])
    assert set(groups) == {"draft", "target"}
    target = _container(groups["target"])["resources"]
    assert int(target["limits"][GPU]) == cfg.target_tp * cfg.target_gpus_per_worker
    assert target["requests"][GPU] == target["limits"][GPU]
    draft = _container(groups["draft"])["resources"]
    assert float(draft["limits"][GPU]) >= cfg.draft_num_gpus > 0
    assert float(capacity.parse_quantity(target["limits"]["cpu"])) >= sum(b["CPU"] for b in cfg.target_bundles())
    for name in ("draft", "target"):
        pod = groups[name]["template"]["spec"]
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"]
    assert groups["draft"]["template"]["spec"]["nodeSelector"] != groups["target"]["template"]["spec"]["nodeSelector"]


def test_cpu_dev_has_no_gpus(rendered):
    text = yaml.safe_dump_all(rendered["cpu-dev"])
    assert GPU not in text


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_head_runs_no_replicas_and_ports_are_named(rendered, overlay):
    rc = _rayservice(rendered[overlay])["spec"]["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True
    head = rc["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    ports = {p["name"]: p["containerPort"] for p in _container(head)["ports"]}
    assert ports | checks.HEAD_PORTS == ports
    for g in rc["workerGroupSpecs"]:
        c = _container(g)
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == checks.WORKER_PORTS
        assert c["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": 8000}
    svc = _rayservice(rendered[overlay])["spec"]["serveService"]
    # only "serve": KubeRay before kuberay#4558 drops every other port of a custom serveService
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"serve": 8000}
    grpc_svc = next(d for d in rendered[overlay] if d.get("kind") == "Service" and d["metadata"]["name"] == "specdec-grpc")
    assert grpc_svc["spec"]["ports"] == [{"name": "serve-grpc", "port": 9000, "targetPort": "serve-grpc",
                                          "protocol": "TCP", "appProtocol": "grpc"}]
    assert grpc_svc["spec"]["selector"] == {"app.kubernetes.io/part-of": "specdec", "ray.io/node-type": "worker",
                                            "ray.io/serve": "true"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_container_caps_grpc_messages_as_specdec_serve_does(rendered, overlay):
    """Serve's gRPC proxy runs on every node (proxy_location EveryNode) and reads up to Serve's
    default 2 GiB per message, before the router authenticates it. `specdec serve` caps it at
    GRPC_MAX_MESSAGE_BYTES; under KubeRay (`ray start`) only the pod env can: head and every worker."""
    from deployments.cli import GRPC_MAX_MESSAGE_BYTES

    assert GRPC_MAX_MESSAGE_BYTES == 64 * 2**20
    rc = _rayservice(rendered[overlay])["spec"]["rayClusterConfig"]
    containers = {"head": _container(rc["headGroupSpec"])} | {g["groupName"]: _container(g) for g in rc["workerGroupSpecs"]}
    assert set(containers) == {"head", *{"cpu-dev": ["cpu"], "gpu": ["draft", "target"]}[overlay]}
    for where, c in containers.items():
        env = [e for e in c["env"] if e["name"] == "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]
        assert env == [{"name": "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", "value": str(GRPC_MAX_MESSAGE_BYTES)}], where
    assert val.validate_overlay(overlay, rendered[overlay]) == []


# --- secrets -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tenants_secret_holds_only_hashes(rendered, overlay):
    from specdec.control.tenants import parse_tenants_config

    (secret,) = [d for d in rendered[overlay] if d["kind"] == "Secret"]
    text = base64.b64decode(secret["data"]["tenants.yaml"]).decode()
    cfg = parse_tenants_config(text)
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for t in cfg.tenants for h in t.api_key_hashes)
    assert not checks.PLAINTEXT_KEY.search(text)


def test_no_plaintext_key_committed_under_k8s():
    files = subprocess.run(["git", "ls-files", "k8s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = files or [str(p.relative_to(ROOT)) for p in K8S.rglob("*") if p.is_file()]
    for f in files:
        assert not checks.PLAINTEXT_KEY.search((ROOT / f).read_text(errors="replace")), f
    assert subprocess.run(["git", "check-ignore", "-q", "k8s/overlays/prod/tenants.local.yaml"], cwd=ROOT).returncode == 0


# --- a broken manifest fails ------------------------------------------------------------------------


def _rs(d):
    return _rayservice(d)


def _wg(d, name):
    return next(g for g in _rs(d)["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == name)


def _kind(d, kind, name_prefix=""):
    return next(x for x in d if x["kind"] == kind and x["metadata"]["name"].startswith(name_prefix))


def _set_serve(d, fn):
    rs = _rs(d)
    cfg = yaml.safe_load(rs["spec"]["serveConfigV2"])
    fn(cfg)
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)


def _plaintext_secret(d):
    s = _kind(d, "Secret", "specdec-tenants")
    bad = "tenants:\n- id: a\n  api_key_hashes: [x]\n  api_key: sk-" + "A" * 43 + "\n"
    s["data"]["tenants.yaml"] = base64.b64encode(bad.encode()).decode()


BROKEN = [
    # (id, overlay, mutation, a substring of an expected error)
    ("crd-unknown-field", "gpu",
     lambda d: _rs(d)["spec"]["rayClusterConfig"].__setitem__("workerGroupSpec", []), "'workerGroupSpec' was unexpected"),
    ("crd-rayStartParams-not-string", "gpu",
     lambda d: _rs(d)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0), "is not of type 'string'"),
    ("crd-bad-quantity", "cpu-dev",
     lambda d: _container(_wg(d, "cpu"))["resources"]["limits"].__setitem__("memory", "lots"), "does not match"),
    ("crd-missing-required", "gpu",
     lambda d: _wg(d, "draft").pop("maxReplicas"), "'maxReplicas' is a required property"),
    ("core-service-port-type", "gpu",
     lambda d: _kind(d, "Service", "specdec-metrics")["spec"]["ports"][0].__setitem__("port", "eighty"), "is not of type 'integer'"),
    ("core-pdb-typo", "cpu-dev",
     lambda d: _kind(d, "PodDisruptionBudget")["spec"].__setitem__("maxUnavailabel", 1), "'maxUnavailabel' was unexpected"),
    ("core-pod-template", "gpu",
     lambda d: _container(_wg(d, "target")).__setitem__("imagePulPolicy", "Always"), "'imagePulPolicy' was unexpected"),
    ("servicemonitor-typo", "gpu",
     lambda d: _kind(d, "ServiceMonitor")["spec"]["endpoints"][0].__setitem__("intervall", "15s"), "'intervall' was unexpected"),
    ("tp-gpus-mismatch", "gpu",
     lambda d: [_container(_wg(d, "target"))["resources"][k].__setitem__(GPU, "1") for k in ("limits", "requests")],
     "!= target_tp x target_gpus_per_worker"),
    ("draft-without-gpu", "gpu",
     lambda d: [_container(_wg(d, "draft"))["resources"][k].pop(GPU) for k in ("limits", "requests")], "< draft_num_gpus"),
    ("gpu-on-cpu-dev", "cpu-dev",
     lambda d: [_container(_wg(d, "cpu"))["resources"][k].__setitem__(GPU, "1") for k in ("limits", "requests")],
     "uses no GPU but worker groups"),
    ("target-pod-too-small", "gpu",
     lambda d: _container(_wg(d, "target"))["resources"]["limits"].__setitem__("cpu", "2"), "placement group"),
    ("gpu-without-toleration", "gpu",
     lambda d: _wg(d, "target")["template"]["spec"].pop("tolerations"), "toleration"),
    ("head-num-cpus", "cpu-dev",
     lambda d: _rs(d)["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", "4"), 'num-cpus must be "0"'),
    ("prefetch-cpu-default-on-gpu-pod", "gpu",
     lambda d: _wg(d, "target")["template"]["spec"]["initContainers"][0].__setitem__(
         "command", ["specdec", "prefetch", "target", "draft"]), "add --format bfloat16"),
    ("prefetch-format-on-cpu-pod", "cpu-dev",
     lambda d: _wg(d, "cpu")["template"]["spec"]["initContainers"][0]["command"].extend(["--format", "bfloat16"]),
     "drop its --format"),
    ("autoscaling-off", "gpu",
     lambda d: _rs(d)["spec"]["rayClusterConfig"].__setitem__("enableInTreeAutoscaling", False), "enableInTreeAutoscaling"),
    ("grpc-port-renamed", "gpu",
     lambda d: next(p for p in _container(_wg(d, "draft"))["ports"] if p["containerPort"] == 9000).__setitem__("name", "grpc"),
     "'serve-grpc' must be 9000"),
    ("no-grpc-service", "cpu-dev",
     lambda d: d.remove(_kind(d, "Service", "specdec-grpc")), "no Service exposes the gRPC port"),
    ("grpc-service-selects-head", "gpu",
     lambda d: _kind(d, "Service", "specdec-grpc")["spec"].__setitem__("selector", {"app.kubernetes.io/part-of": "specdec"}),
     "no head"),
    ("grpc-port-on-serve-service", "gpu",
     lambda d: _rs(d)["spec"]["serveService"]["spec"]["ports"].append({"name": "serve-grpc", "port": 9000}),
     "are dropped by KubeRay"),
    ("draft-not-pinned", "gpu",
     lambda d: _wg(d, "draft")["rayStartParams"].pop("resources"), "no worker group advertises"),
    ("pin-resource-garbled", "gpu",
     lambda d: _wg(d, "target")["rayStartParams"].__setitem__("resources", "{specdec_target_node: 1000"),
     "not the quoted JSON"),
    ("draft-pinned-to-target-pool", "gpu",
     lambda d: _wg(d, "target")["rayStartParams"].__setitem__(
         "resources", '"{\\"specdec_target_node\\": 1000, \\"specdec_draft_node\\": 1000}"'),
     "pinned to a resource the target group advertises"),
    ("no-readiness", "cpu-dev",
     lambda d: _container(_wg(d, "cpu")).pop("readinessProbe"), "/-/healthz"),
    ("serve-config-edited", "gpu",
     lambda d: _set_serve(d, lambda c: c["applications"][0]["deployments"][0].__setitem__("max_ongoing_requests", 99)),
     "not the Serve config of AppConfig"),
    ("serve-config-invalid", "cpu-dev",
     lambda d: _set_serve(d, lambda c: c["applications"][0]["deployments"][0].__setitem__("max_ongoing_requests", "many")),
     "Ray Serve's schema"),
    ("plaintext-key-in-secret", "gpu", _plaintext_secret, "plaintext API key"),
    ("tenants-not-mounted", "gpu",
     lambda d: _container(_wg(d, "draft"))["volumeMounts"].pop(0), "tenants Secret must be mounted"),
    ("head-grpc-cap-missing", "gpu",
     lambda d: _container(_rs(d)["spec"]["rayClusterConfig"]["headGroupSpec"]).pop("env"),
     'head: env RAY_SERVE_GRPC_MAX_MESSAGE_SIZE must be "67108864" (deployments/cli.py GRPC_MAX_MESSAGE_BYTES; has None)'),
    ("worker-grpc-cap-default", "cpu-dev",
     lambda d: next(e for e in _container(_wg(d, "cpu"))["env"] if e["name"] == "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE")
     .__setitem__("value", str(2 * 2**30)),
     "workerGroup cpu: env RAY_SERVE_GRPC_MAX_MESSAGE_SIZE must be \"67108864\" (deployments/cli.py "
     "GRPC_MAX_MESSAGE_BYTES; has '2147483648')"),
    ("no-model-cache-env", "cpu-dev",
     lambda d: _container(_wg(d, "cpu")).pop("env"), "SPECDEC_CACHE"),
    ("metrics-service-misses-pods", "gpu",
     lambda d: _kind(d, "Service", "specdec-metrics")["spec"].__setitem__("selector", {"app": "nothing"}), "does not select"),
]


@pytest.mark.parametrize("overlay,mutate,expected", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_manifest_fails(rendered, overlay, mutate, expected):
    docs = copy.deepcopy(rendered[overlay])
    mutate(docs)
    errors = val.validate_overlay(overlay, docs)
    assert any(expected in e for e in errors), errors


# --- the validator's pieces ------------------------------------------------------------------------


def test_crd_conversion_handles_kubernetes_extensions():
    import jsonschema

    schema = schemas.crd_to_json_schema({
        "type": "object",
        "properties": {
            "q": {"x-kubernetes-int-or-string": True},
            "n": {"type": "string", "nullable": True},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {"type": "integer"}}},
            "m": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    })
    v = jsonschema.Draft7Validator(schema)
    assert not list(v.iter_errors({"q": 3, "n": None, "free": {"a": 1, "other": 2}, "m": {"k": "v"}}))
    assert not list(v.iter_errors({"q": "500m"}))
    assert list(v.iter_errors({"q": 1.5}))
    assert list(v.iter_errors({"typo": 1}))  # strict: unknown fields are errors
    assert list(v.iter_errors({"m": {"k": 1}}))


def test_missing_kubectl_fails_clearly(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(val.KubectlMissing, match="kubectl is not on PATH"):
        val.render("cpu-dev")


def test_parse_quantity():
    assert capacity.parse_quantity("500m") == 0.5
    assert capacity.parse_quantity("8Gi") == 8 * 2**30
    assert capacity.parse_quantity(2) == 2
    with pytest.raises(ValueError):
        capacity.parse_quantity("lots")


# --- Grafana dashboard ------------------------------------------------------------------------------

def test_grafana_dashboard():
    """Panels for every topic, including K under load; every ray_specdec_* name a panel reads is
    a metric the code exports (deployments/metrics.py), documented in k8s/README.md."""
    dash = json.loads((K8S / "grafana" / "specdec-dashboard.json").read_text())
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("acceptance", "k chosen", "tokens/s", "draft vs verify", "first token", "status",
                  "predicted vs measured speedup", "draft position", "inter-token", "k under load",
                  "batch seen per tenant"):
        assert topic in titles, topic
    assert dashboard.check_dashboard(dash) == []
    exported = dashboard.exported_metric_names()
    used = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            used |= {re.sub(r"_(bucket|sum|count)$", "", m) if m not in exported else m
                     for m in re.findall(r"\bray_specdec_[a-z_]+", t["expr"])}
    # the batch gauges and the target's batch histograms have panels
    assert {"ray_specdec_batch_k", "ray_specdec_batch_rows_seen", "ray_specdec_batch_positions_seen",
            "ray_specdec_batch_rows", "ray_specdec_batch_positions", "ray_specdec_chosen_k"} <= used
    assert used <= set(exported)


def test_grafana_dashboard_check_notices_unknown_misread_and_undocumented_metrics():
    dash = json.loads((K8S / "grafana" / "specdec-dashboard.json").read_text())
    broken = copy.deepcopy(dash)
    panel = next(p for p in broken["panels"] if p["title"].startswith("K under load"))
    panel["targets"][0]["expr"] = "max by (tenant) (ray_specdec_batch_kk)"
    panel["targets"][1]["expr"] = "rate(ray_specdec_batch_k_sum[1m])"
    errors = dashboard.check_dashboard(broken)
    assert len(errors) == 2
    assert "ray_specdec_batch_kk is not a metric the code exports" in errors[0]
    assert "ray_specdec_batch_k_sum reads a gauge as a histogram" in errors[1]
    readme = (K8S / "README.md").read_text().replace("`ray_specdec_batch_rows_seen`", "`rows_seen`")
    assert dashboard.check_dashboard(dash, readme) == [
        "ray_specdec_batch_rows_seen is used by the dashboard but not documented in k8s/README.md"]
    panel["targets"] = []
    assert "panel 'K under load per tenant and draft replica' has no query" in dashboard.check_dashboard(broken)


def test_documented_cluster_overlay_replaces_tenants_and_image(tmp_path):
    """The README's cluster overlay (secretGenerator behavior: replace from a git-ignored file,
    namespace, image) renders and validates; the Secret then holds the new hash only."""
    import os

    from specdec.control.tenants import generate_api_key, hash_api_key

    key = generate_api_key()
    (tmp_path / "tenants.local.yaml").write_text(f"tenants:\n  - id: team-a\n    api_key_hashes: [{hash_api_key(key)}]\n")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "specdec",
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
        "secretGenerator": [{"name": "specdec-tenants", "behavior": "replace", "files": ["tenants.yaml=tenants.local.yaml"]}],
        "images": [{"name": "registry.example.com/specdec", "newName": "ghcr.io/acme/specdec", "newTag": "1.2.3"}],
    }))
    out = subprocess.run([val.kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert key not in out
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert val.validate_overlay("gpu", docs) == []
    assert {d["metadata"].get("namespace") for d in docs} == {"specdec"}
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    text = base64.b64decode(secret["data"]["tenants.yaml"]).decode()
    assert hash_api_key(key) in text and "example-team" not in text
    rs = _rayservice(docs)
    vols = [v for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] for v in g["template"]["spec"]["volumes"] if "secret" in v]
    assert {v["secret"]["secretName"] for v in vols} == {secret["metadata"]["name"]}
    assert _container(rs["spec"]["rayClusterConfig"]["headGroupSpec"])["image"] == "ghcr.io/acme/specdec:1.2.3"


def test_vendored_crd_is_the_release_the_readme_installs(monkeypatch):
    """The tests need nothing outside the repository: the RayService CRD is vendored, and it is
    KubeRay's release that k8s/README.md installs, byte for byte (checksum of the v1.5.1 tag)."""
    import hashlib

    monkeypatch.delenv("KUBERAY_RAYSERVICE_CRD", raising=False)
    path = schemas.crd_path()
    assert path == K8S / "schemas" / "ray.io_rayservices.yaml"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == schemas.CRD_SHA256
    readme = (K8S / "README.md").read_text()
    (helm_version,) = re.findall(r"kuberay/kuberay-operator \\\n.*--version (\S+)", readme)
    assert "v" + helm_version == schemas.CRD_VERSION == "v1.5.1"
    notes = (K8S / "schemas" / "README.md").read_text()
    assert "KubeRay v1.5.1" in notes and schemas.CRD_SHA256 in notes
    assert "github.com/ray-project/kuberay/blob/v1.5.1/ray-operator/config/crd/bases/ray.io_rayservices.yaml" in notes


def test_cli_refuses_an_unknown_overlay_and_answers_help(capsys):
    """`python k8s/validate.py --help` printed a traceback (``--help`` was rendered as an overlay
    named '--help'); a misspelt overlay did the same. Both are argparse's answers now, before
    anything is rendered; no name is every overlay."""
    with pytest.raises(SystemExit) as e:
        val.parse_overlay_names(["--help"])
    assert e.value.code == 0
    assert "OVERLAY" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        val.main(["gpus"])
    assert e.value.code == 2
    assert "no overlay 'gpus' in k8s/overlays (overlays: cpu-dev, gpu)" in capsys.readouterr().err
    assert val.parse_overlay_names([]) == ["cpu-dev", "gpu"]
    assert val.parse_overlay_names(["gpu"]) == ["gpu"]
