"""The one AppConfig -> Serve config files; the committed YAML files are up to date."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from deployments import write_configs
from deployments.config import PRESETS, AppConfig, Scaling, to_serve_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_committed_yaml_is_regenerated_identically(name):
    path = write_configs.HERE / name
    assert path.read_text() == write_configs.render(name), "run python -m deployments.write_configs"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_passes_serve_schema(name):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((write_configs.HERE / name).read_text())
    ServeDeploySchema.model_validate(data)
    for dep in data["applications"][0]["deployments"]:
        if "autoscaling_config" in dep:
            AutoscalingConfig(**dep["autoscaling_config"])
    assert AppConfig.model_validate(data["applications"][0]["args"]) == PRESETS[name]


def test_target_placement_group_has_one_bundle_per_rank():
    cfg = AppConfig(target_tp=2, target_gpus_per_worker=1, target_cpus_per_worker=2, target_replica_cpus=1)
    target = {d["name"]: d for d in to_serve_config(cfg)["applications"][0]["deployments"]}["Target"]
    assert target["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}]
    assert target["placement_group_strategy"] == "STRICT_PACK"
    assert target["ray_actor_options"] == {"num_cpus": 1}  # must fit bundle 0
    assert target["request_router_config"]["request_router_class"].endswith("ConsistentHashRouter")


def test_local_cpu_fits_two_cpus():
    cfg = PRESETS["local-cpu.yaml"]
    total = (cfg.router_num_cpus * cfg.router.max_replicas + cfg.draft_num_cpus * cfg.draft.max_replicas
             + sum(b["CPU"] for b in cfg.target_bundles()) * cfg.target.max_replicas)
    assert total <= 2


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_built_deployment_has_options(name):
    deps = [d["name"] for d in to_serve_config(PRESETS[name])["applications"][0]["deployments"]]
    assert deps == ["Router", "Draft", "Target"]
    opts = {d["name"]: d for d in to_serve_config(PRESETS[name])["applications"][0]["deployments"]}
    assert opts["Draft"]["request_router_config"]["request_router_class"].endswith("ConsistentHashRouter")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_stopping_replica_checks_its_requests_every_fifth_of_a_second(name):
    """Serve's default ``graceful_shutdown_wait_loop_s`` (2 s) is also the least a stopping
    replica waits, and Serve stops Router, Draft and Target one after another: 6 of the ~9 s
    ``specdec serve`` took to stop on Ctrl-C. Every deployment polls every 0.2 s; the time its
    requests in flight may run on (``graceful_shutdown_timeout_s``) stays Serve's 20 s."""
    deps = to_serve_config(PRESETS[name])["applications"][0]["deployments"]
    assert [(d["name"], d["graceful_shutdown_wait_loop_s"]) for d in deps] == [
        ("Router", 0.2), ("Draft", 0.2), ("Target", 0.2)]
    assert all("graceful_shutdown_timeout_s" not in d for d in deps)
    data = yaml.safe_load((write_configs.HERE / name).read_text())
    assert [d["graceful_shutdown_wait_loop_s"] for d in data["applications"][0]["deployments"]] == [0.2] * 3


def test_router_autoscales_when_range_given():
    out = to_serve_config(PRESETS["gpu.yaml"])
    router = out["applications"][0]["deployments"][0]
    assert router["name"] == "Router" and router["autoscaling_config"]["max_replicas"] == 4
    assert "num_replicas" not in router
    assert out["grpc_options"]["port"] == 9000 and out["http_options"]["port"] == 8000


def test_bad_config_is_rejected():
    with pytest.raises(ValidationError):
        AppConfig(target_tp=0)
    with pytest.raises(ValidationError):
        Scaling(min_replicas=3, max_replicas=1)
    with pytest.raises(ValidationError):
        AppConfig(unknown_field=1)


def test_one_port_for_grpc_and_http_is_refused():
    """Serve's two proxies both bound a shared port (SO_REUSEPORT) and split its connections."""
    with pytest.raises(ValidationError) as info:
        AppConfig(grpc_port=8000, http_port=8000)
    assert [e["msg"] for e in info.value.errors()] == [
        "Value error, grpc_port and http_port are both 8000: the gRPC and HTTP proxies need a port each"]


def test_a_format_name_is_lower_case_and_refused_with_the_choices(monkeypatch):
    """target_dtype / draft_dtype take the lower-case format names exactly (README "Weight formats":
    only $SPECDEC_WEIGHT_FORMAT is read case-insensitively); another is refused naming them all."""
    for field in ("target_dtype", "draft_dtype"):
        with pytest.raises(ValidationError) as info:
            AppConfig(**{field: "W7A8"})
        assert [(e["loc"], e["msg"]) for e in info.value.errors()] == [
            ((field,), "Input should be 'float32', 'bfloat16', 'float16', 'int8', 'int4', 'w8a8' or 'w7a8'")]
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", " W7A8 ")
    cfg = AppConfig()
    assert (cfg.target_format(), cfg.draft_format()) == ("w7a8", "w7a8")


@pytest.mark.parametrize("name", ["", "a/b", "-x", "has space", "x" * 65, "ünï"])
def test_an_app_name_that_cannot_name_a_route_and_an_actor_is_refused(name):
    """app_name is the gRPC `application`, the HTTP route prefix and part of the shared
    controller actor's name: refused when loading the config, naming the field, rather than
    failing the replicas at start-up (an empty name made the actor's name raise there)."""
    with pytest.raises(ValidationError) as info:
        AppConfig(app_name=name)
    assert info.value.errors()[0]["loc"] == ("app_name",)
    for good in ("specdec", "test-app-a", "batched-v", "a.b_c"):
        assert AppConfig(app_name=good).app_name == good
