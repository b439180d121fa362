"""Capacity and placement of a rendered overlay's worker groups against the AppConfig.

GPUs and CPUs per worker group enough for the target's tensor-parallel placement group
(STRICT_PACK) and for every deployment at ``max_replicas``; the custom Ray resources that pin each
deployment to its pool advertised by the right group. :func:`check_capacity` is called by
:func:`specdec_checks.check_specdec`; like every check here it returns a list of error strings
(empty: valid).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: The Kubernetes extended resource name of an NVIDIA GPU.
GPU = "nvidia.com/gpu"


def ray_container(template: dict) -> dict:
    """The Ray container of a pod template (KubeRay: index 0 unless RAY_CONTAINER_INDEX)."""
    containers = (template.get("spec") or {}).get("containers") or [{}]
    return containers[0]


def parse_quantity(q: Any) -> float:
    """A Kubernetes quantity (``"500m"``, ``2``, ``"8Gi"``) as a number."""
    if isinstance(q, (int, float)):
        return float(q)
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", str(q).strip())
    if not m:
        raise ValueError(f"not a quantity: {q!r}")
    num, suffix = float(m.group(1)), m.group(2)
    factors = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
               "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "n": 1e-9, "u": 1e-6}
    if suffix not in factors:
        raise ValueError(f"unknown quantity suffix in {q!r}")
    return num * factors[suffix]


def limit_of(container: dict, name: str) -> float:
    """A container's limit of resource ``name`` (0 when absent): Ray's count comes from it."""
    limits = (container.get("resources") or {}).get("limits") or {}
    return parse_quantity(limits[name]) if name in limits else 0.0


def check_capacity(cfg, groups: dict[str, dict]) -> list[str]:
    """GPU/CPU counts of the worker groups against the AppConfig."""
    errors = []
    cont = {name: ray_container(g.get("template") or {}) for name, g in groups.items()}
    gpu = {name: limit_of(c, GPU) for name, c in cont.items()}
    cpu = {name: limit_of(c, "cpu") for name, c in cont.items()}
    pg_cpu = sum(b["CPU"] for b in cfg.target_bundles())
    tp_gpus = cfg.target_tp * cfg.target_gpus_per_worker
    if tp_gpus:
        if "target" not in groups:
            errors.append("the AppConfig's target uses GPUs: a worker group named 'target' is needed")
        else:
            if gpu["target"] != math.ceil(tp_gpus):
                errors.append(f"workerGroup target: {GPU} limit {gpu['target']:g} != target_tp x target_gpus_per_worker "
                              f"= {cfg.target_tp} x {cfg.target_gpus_per_worker:g}")
            if cpu["target"] < pg_cpu:
                errors.append(f"workerGroup target: cpu limit {cpu['target']:g} < the placement group's {pg_cpu:g} CPUs (STRICT_PACK)")
            if groups["target"].get("maxReplicas", 0) < cfg.target.max_replicas:
                errors.append(f"workerGroup target: maxReplicas < the Target deployment's max_replicas {cfg.target.max_replicas}")
    if cfg.draft_num_gpus:
        if "draft" not in groups:
            errors.append("the AppConfig's draft uses a GPU: a worker group named 'draft' is needed")
        else:
            if gpu["draft"] < max(cfg.draft_num_gpus, 1):
                errors.append(f"workerGroup draft: {GPU} limit {gpu['draft']:g} < draft_num_gpus {cfg.draft_num_gpus:g}")
            if cpu["draft"] < cfg.draft_num_cpus:
                errors.append(f"workerGroup draft: cpu limit {cpu['draft']:g} < draft_num_cpus {cfg.draft_num_cpus:g}")
            per_pod = min(math.floor(gpu["draft"] / cfg.draft_num_gpus + 1e-9), math.floor(cpu["draft"] / cfg.draft_num_cpus + 1e-9))
            if groups["draft"].get("maxReplicas", 0) * per_pod < cfg.draft.max_replicas:
                errors.append("workerGroup draft: maxReplicas x drafts per pod < the Draft deployment's max_replicas")
    if not tp_gpus and not cfg.draft_num_gpus and any(gpu.values()):
        errors.append(f"the AppConfig uses no GPU but worker groups {sorted(n for n, v in gpu.items() if v)} request {GPU}")
    # Some pod must hold a whole target placement group; the whole cluster at maxReplicas must hold
    # every deployment at max_replicas.
    fits = [n for n in groups if cpu[n] >= pg_cpu and gpu[n] >= math.ceil(tp_gpus)]
    if not fits:
        errors.append(f"no worker group can hold the target's placement group ({pg_cpu:g} CPU, {tp_gpus:g} GPU, STRICT_PACK)")
    need_cpu = (cfg.target.max_replicas * pg_cpu + cfg.router.max_replicas * cfg.router_num_cpus
                + cfg.draft.max_replicas * cfg.draft_num_cpus)
    need_gpu = cfg.target.max_replicas * tp_gpus + cfg.draft.max_replicas * cfg.draft_num_gpus
    have_cpu = sum(groups[n].get("maxReplicas", 0) * cpu[n] for n in groups)
    have_gpu = sum(groups[n].get("maxReplicas", 0) * gpu[n] for n in groups)
    if have_cpu < need_cpu or have_gpu < need_gpu:
        errors.append(f"worker groups at maxReplicas give {have_cpu:g} CPU / {have_gpu:g} GPU < the "
                      f"{need_cpu:g} CPU / {need_gpu:g} GPU of every deployment at max_replicas")
    errors += check_pinning(cfg, groups)
    return errors


def group_custom_resources(group: dict) -> dict[str, float]:
    """The custom Ray resources a worker group advertises (``rayStartParams.resources``, the
    shell-quoted JSON KubeRay passes to ``ray start --resources``)."""
    raw = (group.get("rayStartParams") or {}).get("resources")
    if not raw:
        return {}
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1].replace('\\"', '"')
    try:
        data = json.loads(text)
    except ValueError:
        return {"<unparseable>": 0.0}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {"<unparseable>": 0.0}


def check_pinning(cfg, groups: dict[str, dict]) -> list[str]:
    """Each deployment's custom resources are advertised by the worker group meant for it: the
    Target's by the group that holds its GPUs, the Draft's and Router's by another one."""
    errors = []
    adv = {name: group_custom_resources(g) for name, g in groups.items()}
    for name, res in adv.items():
        if "<unparseable>" in res:
            errors.append(f"workerGroup {name}: rayStartParams.resources is not the quoted JSON KubeRay expects")
    wants = {"Router": cfg.router_resources, "Draft": cfg.draft_resources, "Target": cfg.target_resources}
    homes: dict[str, set[str]] = {}
    for dep, res in wants.items():
        for key, amount in res.items():
            have = [n for n, r in adv.items() if r.get(key, 0.0) >= amount]
            if not have:
                errors.append(f"{dep} needs custom resource {key!r} that no worker group advertises: it would never be placed")
            homes[dep] = homes.get(dep, set()) | set(have)
    tp_gpus = cfg.target_tp * cfg.target_gpus_per_worker
    if tp_gpus and "target" in groups:
        if cfg.draft_num_gpus and not cfg.draft_resources:
            errors.append("the Draft uses a GPU slice but is not pinned to its pool (draft_resources): "
                          "it may land on a target pod and break the Target's STRICT_PACK GPU placement")
        for dep in ("Router", "Draft"):
            if "target" in homes.get(dep, set()):
                errors.append(f"{dep} is pinned to a resource the target group advertises")
        if "Target" in homes and homes["Target"] != {"target"}:
            errors.append(f"Target is pinned to groups {sorted(homes['Target'])}, not only 'target'")
    return errors
