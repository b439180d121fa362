"""Generic offline schema validation of rendered Kubernetes manifests (no API server needed).

Nothing here knows what specdec needs of its deployment (that is :mod:`specdec_checks`); this
module only asks whether each object is well-formed for the API server that would receive it:

- A ``RayService`` is checked against KubeRay's CRD (``spec.versions[v1].schema.openAPIV3Schema``
  converted to JSON Schema by :func:`crd_to_json_schema`: ``x-kubernetes-int-or-string``,
  ``nullable`` and, like the API server's strict field validation, unknown fields rejected
  unless ``x-kubernetes-preserve-unknown-fields``). CEL rules (``x-kubernetes-validations``)
  are not evaluated. The CRD is vendored in ``k8s/schemas/`` (:data:`CRD_FILE`,
  :data:`CRD_VERSION`, :data:`CRD_SHA256`); ``$KUBERAY_RAYSERVICE_CRD`` overrides it.
- Core objects (and the pod templates and Serve Service embedded in the RayService) are checked
  with ``kubernetes_validate`` against Kubernetes :data:`K8S_VERSION`, strict (unknown fields
  are errors).
- The ServiceMonitor (a CRD of the Prometheus Operator, not vendored here) is checked against a
  hand-written schema of the fields we use (:data:`SERVICEMONITOR_SCHEMA`).

Every check returns a list of error strings (empty: valid). ``k8s/validate.py`` renders the
overlays and runs these checks, then :func:`specdec_checks.check_specdec`.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import yaml

K8S_DIR = Path(__file__).resolve().parent
ROOT = K8S_DIR.parent

#: Kubernetes version whose schemas (shipped by kubernetes-validate) core objects must satisfy.
K8S_VERSION = "1.32"
#: KubeRay's RayService CRD, vendored (k8s/schemas/README.md): the release k8s/README.md installs.
#: $KUBERAY_RAYSERVICE_CRD overrides it (e.g. to check against a newer release).
CRD_FILE = K8S_DIR / "schemas" / "ray.io_rayservices.yaml"
CRD_VERSION = "v1.5.1"
CRD_SHA256 = "563d23ba5a73e5ca4b949ae7f41ff43468ce069afe336ebcb45db2beeb9a62ab"


def pod_templates(rs: dict) -> list[tuple[str, dict]]:
    """``(where, pod template)`` of a RayService's head group and each worker group."""
    rc = (rs.get("spec") or {}).get("rayClusterConfig") or {}
    out = []
    head = (rc.get("headGroupSpec") or {}).get("template")
    if head is not None:
        out.append(("headGroupSpec", head))
    for g in rc.get("workerGroupSpecs") or []:
        out.append((f"workerGroup {g.get('groupName')}", g.get("template") or {}))
    return out


def crd_path() -> Path:
    """The RayService CRD to validate against: $KUBERAY_RAYSERVICE_CRD, else :data:`CRD_FILE`."""
    env = os.environ.get("KUBERAY_RAYSERVICE_CRD")
    p = Path(env) if env else CRD_FILE
    if not p.is_file():
        raise FileNotFoundError(
            f"KubeRay's RayService CRD not found at {p} (the repository vendors KubeRay {CRD_VERSION}'s as "
            f"{CRD_FILE.relative_to(ROOT)}; $KUBERAY_RAYSERVICE_CRD may point to another release's "
            "ray-operator/config/crd/bases/ray.io_rayservices.yaml)"
        )
    return p


def crd_to_json_schema(node: Any, strict: bool = True) -> Any:
    """A CRD ``openAPIV3Schema`` (sub)tree as JSON Schema.

    - ``x-kubernetes-int-or-string: true``: integer or string (controller-gen already writes the
      ``anyOf``; added when missing);
    - ``nullable: true``: ``null`` allowed too;
    - ``strict``: objects with ``properties`` reject other fields (the API server's strict field
      validation; without it they would be silently pruned) unless
      ``x-kubernetes-preserve-unknown-fields``;
    - other ``x-kubernetes-*`` extensions and descriptions are dropped.
    """
    if isinstance(node, list):
        return [crd_to_json_schema(n, strict) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: crd_to_json_schema(sub, strict) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = crd_to_json_schema(value, strict)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [crd_to_json_schema(sub, strict) for sub in value]
        elif key.startswith("x-kubernetes-") or key in ("nullable", "description", "example", "externalDocs"):
            continue
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable"):
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    if (
        strict
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def rayservice_validator(version: str = "v1"):
    """A jsonschema validator for ``ray.io/<version>`` RayService objects."""
    import jsonschema

    with open(crd_path()) as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayService", crd["spec"]["names"]
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = crd_to_json_schema(ver["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _path(error) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "<root>"


def validate_rayservice(obj: dict) -> list[str]:
    """Errors of a RayService against the KubeRay CRD schema."""
    api = obj.get("apiVersion", "")
    if not api.startswith("ray.io/"):
        return [f"RayService apiVersion {api!r} is not ray.io/*"]
    errors = [f"RayService {_path(e)}: {e.message}" for e in rayservice_validator(api.split("/", 1)[1]).iter_errors(obj)]
    name = (obj.get("metadata") or {}).get("name")
    if not name or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
        errors.append(f"RayService metadata.name {name!r} is not a DNS-1123 label")
    return errors


def validate_core(obj: dict, version: str = K8S_VERSION) -> list[str]:
    """Errors of a core Kubernetes object against the upstream schema (strict)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(str(p) for p in e.path) if hasattr(e, "path") else ""
        return [f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: {where} {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{obj.get('kind')}: no schema for {obj.get('apiVersion')} in Kubernetes {version}: {e}"]
    return []


_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
                            "lowercase", "uppercase", "keepequal", "dropequal",
                            "Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep",
                            "Lowercase", "Uppercase", "KeepEqual", "DropEqual"]},
    },
}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"], "additionalProperties": False,
            "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
#: monitoring.coreos.com/v1 ServiceMonitor: the subset of fields specdec uses (unknown fields are
#: errors, so a typo fails; add fields here when the manifest starts using them).
SERVICEMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        }},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "sampleLimit": {"type": "integer", "minimum": 0},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "targetPort": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                        "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"},
                        "honorTimestamps": {"type": "boolean"},
                        "relabelings": {"type": "array", "items": _RELABEL},
                        "metricRelabelings": {"type": "array", "items": _RELABEL},
                    },
                }},
            },
        },
    },
}


def validate_servicemonitor(obj: dict) -> list[str]:
    import jsonschema

    return [f"ServiceMonitor {_path(e)}: {e.message}" for e in jsonschema.Draft7Validator(SERVICEMONITOR_SCHEMA).iter_errors(obj)]


def validate_schemas(docs: list[dict]) -> list[str]:
    """Schema errors of every rendered object (RayService: CRD; core: Kubernetes; embedded
    pod templates and the Serve Service: Kubernetes too)."""
    errors: list[str] = []
    for obj in docs:
        kind = obj.get("kind")
        if kind == "RayService":
            errors += validate_rayservice(obj)
            for where, tmpl in pod_templates(obj):
                errors += [f"{where}: {e}" for e in validate_core(
                    {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tmpl})]
            svc = (obj.get("spec") or {}).get("serveService")
            if svc is not None:
                errors += [f"spec.serveService: {e}" for e in validate_core({"apiVersion": "v1", "kind": "Service", **svc})]
        elif kind == "ServiceMonitor":
            errors += validate_servicemonitor(obj)
        else:
            errors += validate_core(obj)
    return errors
