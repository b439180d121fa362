"""``specdec serve``'s argument handling and config loading (no Ray)."""

from __future__ import annotations

import argparse

import pytest

from deployments import cli
from deployments.config import PRESETS
from deployments.write_configs import HERE


def _args(*argv):
    p = argparse.ArgumentParser()
    cli.add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_default_is_the_local_cpu_preset():
    assert cli.load_config(_args()) == PRESETS["local-cpu.yaml"]


def test_serve_config_file_and_overrides():
    cfg = cli.load_config(_args("--config", str(HERE / "gpu.yaml"), "--tp", "1", "--draft", "none", "--grpc-port", "9100"))
    assert cfg.target_tp == 1 and cfg.draft_model is None and cfg.grpc_port == 9100
    assert cfg.target_gpus_per_worker == PRESETS["gpu.yaml"].target_gpus_per_worker


def test_plain_appconfig_yaml(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text("target_model: demo:target\ndraft_model: demo:draft\ntarget_tp: 2\ndefault_max_k: 6\n")
    assert cli.load_config(_args("--config", str(path))).default_max_k == 6


@pytest.mark.parametrize("argv, files, message", [
    # pydantic ValidationError tracebacks naming the field target_tp
    (["--tp", "-1"], {}, "--tp: Input should be greater than or equal to 1"),
    # taken for "not given": the config's TP was served without a word
    (["--tp", "0"], {}, "--tp: Input should be greater than or equal to 1"),
    (["--grpc-port", "70000"], {}, "--grpc-port: Input should be less than or equal to 65535"),
    (["--http-port", "0"], {}, "--http-port: Input should be greater than or equal to 1"),
    # 0 silently meant every CPU of the machine
    (["--num-cpus", "0"], {}, "--num-cpus: Input should be greater than or equal to 1, got 0"),
    (["--metrics-port", "70000"], {}, "--metrics-port: Input should be a port in 1..65535, got 70000"),
    (["--shutdown-grace", "-1"], {}, "--shutdown-grace: Input should be a number of seconds, at least 0, got -1"),
    (["--shutdown-grace", "nan"], {}, "--shutdown-grace: Input should be a number of seconds, at least 0, got nan"),
    # FileNotFoundError / yaml.ParserError / ValidationError tracebacks
    (["--config", "{dir}/missing.yaml"], {}, "cannot read --config {dir}/missing.yaml: No such file or directory"),
    (["--config", "{dir}/a.yaml"], {"a.yaml": "x: [\n"},
     "--config {dir}/a.yaml is not valid YAML: while parsing a flow node expected the node content, but found "
     "'<stream end>' in \"{dir}/a.yaml\", line 2, column 1"),
    (["--config", "{dir}/a.yaml"], {"a.yaml": "target_tp: -3\nnonsense: 1\n"},
     "target_tp in {dir}/a.yaml: Input should be greater than or equal to 1; "
     "nonsense in {dir}/a.yaml: Extra inputs are not permitted"),
    # YAML 1.1 reads 3e4 as a string: pydantic's strict "Input should be a valid integer" said not why
    (["--config", "{dir}/a.yaml"], {"a.yaml": "omp_spin_count: 3e4\n"},
     "omp_spin_count in {dir}/a.yaml: Input should be an integer like 30000, got the string '3e4': YAML reads "
     "3e4 as a string, not a number; write the digits"),
    (["--config", "{dir}/a.yaml"], {"a.yaml": "omp_spin_count: 3.0e+4\n"},
     "omp_spin_count in {dir}/a.yaml: Input should be an integer like 30000, got the float 30000.0"),
    (["--config", "{dir}/a.yaml"], {"a.yaml": "omp_spin_count: '30000'\n"},
     "omp_spin_count in {dir}/a.yaml: Input should be an integer like 30000, got the string '30000'"),
    (["--config", "{dir}/a.yaml"], {"a.yaml": "- 1\n"},
     "--config {dir}/a.yaml must hold a mapping of AppConfig fields, got list"),
    (["--config", "{dir}/a.yaml"], {"a.yaml": "applications: []\n"},
     "--config {dir}/a.yaml: a Serve config file whose first application has no args mapping"),
    # one port for gRPC and HTTP: Serve's two proxies both listened on it (SO_REUSEPORT) and the
    # kernel split the connections between them; `serve` reported ready and half the calls failed
    (["--grpc-port", "8000"], {},
     "--grpc-port and http_port in the local-cpu preset are both 8000: the gRPC, HTTP and metrics servers need a "
     "port each"),
    (["--grpc-port", "8100", "--http-port", "8100"], {},
     "--grpc-port and --http-port are both 8100: the gRPC, HTTP and metrics servers need a port each"),
    (["--metrics-port", "9000"], {},
     "grpc_port in the local-cpu preset and --metrics-port are both 9000: the gRPC, HTTP and metrics servers need "
     "a port each"),
    (["--config", "{dir}/a.yaml"], {"a.yaml": "grpc_port: 7000\nhttp_port: 7000\n"},
     "{dir}/a.yaml: grpc_port and http_port are both 7000: the gRPC and HTTP proxies need a port each"),
    # the demo request's --max-tokens 0 started Ray, loaded the models and only then failed
    (["--demo-request", "--max-tokens", "0"], {}, "--max-tokens: Input should be greater than or equal to 1"),
    (["--demo-request", "--max-tokens", "1000001"], {}, "--max-tokens: Input should be less than or equal to 1000000"),
], ids=["tp-negative", "tp-zero", "grpc-port", "http-port", "num-cpus", "metrics-port", "grace-negative", "grace-nan",
        "config-missing", "config-yaml",
        "config-fields", "config-spin-3e4", "config-spin-float", "config-spin-quoted", "config-list", "config-serve-empty", "grpc-is-http", "grpc-is-http-flags",
        "metrics-is-grpc", "config-grpc-is-http", "demo-max-tokens-0", "demo-max-tokens-huge"])
def test_bad_serve_flags_and_config_files_are_one_line_naming_them(tmp_path, argv, files, message):
    from specdec.errors import SpecDecError

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(SpecDecError) as info:
        cli.load_config(_args(*[a.format(dir=tmp_path) for a in argv]))
    assert str(info.value) == message.format(dir=tmp_path)


def test_module_top_level_imports_no_ray_or_grpc():
    import subprocess
    import sys

    code = "import sys, deployments.cli; print(any(m in sys.modules for m in ('ray', 'grpc')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_serve_first_line_names_weight_formats_and_the_cpu_kernel_level():
    base = PRESETS["local-cpu.yaml"]
    cfg = base.model_copy(update={"target_dtype": "w8a8", "draft_dtype": "int4"})
    assert cli.start_line(cfg, 2, capability="AVX512") == (
        "target demo:target (TP=1, w8a8), draft demo:draft (int4); local Ray with 2 CPUs, CPU kernels AVX512")
    # float32 chosen by default on a CPU without AVX2 or AVX-512: said on the line (AVX2 defaults to int4)
    cfg = base.model_copy(update={"draft_model": None})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(cfg), "target_format", lambda self: "float32")
        assert cli.start_line(cfg, 2, capability="DEFAULT") == (
            "target demo:target (TP=1, float32), no draft; local Ray with 2 CPUs, CPU kernels DEFAULT "
            "(no AVX2 or AVX-512: float32 weights, the quantized formats need them)")
        assert cli.start_line(cfg, 2, capability="AVX2") == (  # float32 from $SPECDEC_WEIGHT_FORMAT: no hint
            "target demo:target (TP=1, float32), no draft; local Ray with 2 CPUs, CPU kernels AVX2")
    # float32 asked for: no hint
    cfg = base.model_copy(update={"target_dtype": "float32", "draft_dtype": "float32"})
    assert cli.start_line(cfg, 4, capability="AVX2") == (
        "target demo:target (TP=1, float32), draft demo:draft (float32); local Ray with 4 CPUs, CPU kernels AVX2")


def test_serve_prints_the_target_replicas_attention_mode():
    """After "ready", ``specdec serve`` says how the target replica's attention computes rows (its
    TP ranks' facts): what a GPU user checks first (one call per row is launch-bound there)."""
    rank = {"device": "cpu", "weight_format": "w8a8", "torch_threads": 2, "attention": "row"}
    assert cli.target_line([rank]) == (
        "target replica: TP=1 on cpu, w8a8, 2 torch threads, one attention call per query row")
    gpu = {**rank, "device": "cuda:0", "weight_format": "bfloat16", "attention": "sequence"}
    assert cli.target_line([gpu, {**gpu, "rank": 1}]) == (
        "target replica: TP=2 on cuda:0, bfloat16, 2 torch threads, "
        "one attention call per sequence (its load-time probe passed)")
    assert cli.target_line([{**rank, "weight_format": "float32", "attention": "transformers"}]).endswith(
        "float32, 2 torch threads, transformers' attention (a forward not made shape-invariant)")
    assert cli.target_line([{**rank, "attention": "other"}]).endswith("2 torch threads, attention other")
    assert cli.target_line([]) == "target replica: no TP rank reported"


def test_serve_prints_both_endpoints():
    lines = cli.endpoint_lines(cli.load_config(_args("--grpc-port", "9100", "--http-port", "8100")))
    assert lines == [
        "gRPC:  localhost:9100  service specdec.v1.SpecDec, metadata application=specdec "
        "(health and reflection on the same port)",
        'HTTP:  http://localhost:8100/specdec/v1  OpenAI API: /models, /completions, /chat/completions (model "specdec")',
    ]


def test_client_flags_carry_the_sampling_surface():
    from deployments.client import InvalidArgument, build_request

    p = argparse.ArgumentParser()
    cli.add_client_arguments(p)
    args = p.parse_args(["x", "--min-p", "0.1", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
                         "--frequency-penalty", "0.25", "--logit-bias", "7=2.5", "--logit-bias", "9=-100",
                         "--min-tokens", "3", "--logprobs", "--top-logprobs", "4"])
    req = build_request("x", **cli.request_kwargs(args))
    s = req.sampling
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (0.1, 1.2, 0.5, 0.25)
    assert dict(s.logit_bias) == {7: 2.5, 9: -100.0}
    assert (req.min_tokens, req.logprobs, req.top_logprobs) == (3, True, 4)
    with pytest.raises(InvalidArgument, match="--logit-bias must be ID=BIAS, got 'seven'"):
        cli.request_kwargs(p.parse_args(["x", "--logit-bias", "seven"]))


def _client_args(*argv):
    p = argparse.ArgumentParser()
    cli.add_client_arguments(p)
    # nothing listens on port 1: a request that were sent would end UNAVAILABLE (exit 1)
    return p.parse_args([*argv, "--address", "localhost:1", "--api-key", "sk-x"])


@pytest.mark.parametrize("argv, message", [
    # named by the wire field (speculation.max_k) after a round trip
    (["x", "-k", "99"], "-k: Input should be less than or equal to 16"),
    # "k must be a whole number in 0..4294967295", the uint32 field's range
    (["x", "-k", "-1"], "-k: Input should be greater than or equal to 0"),
    (["x", "--max-tokens", "-1"], "--max-tokens: Input should be greater than or equal to 1"),
    (["x", "--top-p", "2", "--temperature", "-1"],
     "--temperature: Input should be greater than or equal to 0; --top-p: Input should be less than or equal to 1"),
    (["x", "--logit-bias", "5=500"], "--logit-bias: the bias of token 5 must be in -100..100, got 500.0"),
    (["x", "--top-logprobs", "3"], "--top-logprobs needs --logprobs"),
    (["x", "--min-tokens", "9", "--max-tokens", "8"], "--min-tokens (9) must be <= --max-tokens (8)"),
    (["--message", "robot:hi"], "--message: Input should be 'system', 'user', 'assistant' or 'tool'"),
    # ended in DEADLINE_EXCEEDED from gRPC, as if the server had been slow
    (["x", "--timeout", "-1"], "--timeout must be a positive number of seconds, got -1"),
    (["x", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
    (["x", "--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    # exit 1 with "INVALID_ARGUMENT: " as if the server had answered; the next one had no "specdec client: "
    (["x", "--logit-bias", "seven"], "--logit-bias must be ID=BIAS, got 'seven'"),
    (["--message", "nocolon"], "--message must be ROLE:TEXT, got 'nocolon'"),
    # --tenant-stats ignored --timeout (always 30 s): UNAVAILABLE here
    (["--tenant-stats", "--timeout", "-1"], "--timeout must be a positive number of seconds, got -1"),
], ids=["k-99", "k-negative", "max-tokens", "two-flags", "logit-bias", "top-logprobs", "min-tokens", "role",
        "timeout-negative", "timeout-zero", "timeout-nan", "logit-bias-form", "message-form", "tenant-stats-timeout"])
def test_client_refuses_bad_flags_by_their_flag_name_before_sending(argv, message, capsys):
    assert cli.run_client(_client_args(*argv)) == 2
    assert capsys.readouterr().err == f"specdec client: {message}\n"


def test_client_flag_check_lets_every_valid_flag_through():
    from deployments.client_flags import flag_problem

    args = _client_args("x", "--max-tokens", "16", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "40",
                        "--seed", str(2**64 - 1), "--min-p", "0.05", "--repetition-penalty", "1.1",
                        "--presence-penalty", "-2", "--frequency-penalty", "2", "--logit-bias", "7=-100",
                        "--min-tokens", "16", "--logprobs", "--top-logprobs", "20", "--proposer", "ngram",
                        "-k", "16", "--draft-min-confidence", "1", "--stop", "\n\n", "--timeout", "0.5")
    assert flag_problem(args) is None
    assert flag_problem(_client_args("--message", "system:", "--message", "user:hi", "--max-tokens", "1")) is None


def test_ctrl_c_while_the_models_load_shuts_down_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) while ``serve.run`` waits for the models raised KeyboardInterrupt out
    of ``specdec serve`` (a traceback); now it says so, shuts Serve and Ray down, exits 130."""
    import ray
    from ray import serve

    import deployments.app

    calls = []

    def loading(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append("ray.init"))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "start", lambda *a, **k: calls.append("serve.start"))
    monkeypatch.setattr(serve, "run", loading)
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: calls.append("serve.shutdown"))
    monkeypatch.setattr(cli, "drain_routers", lambda *a, **k: calls.append("drain") or NOTHING_DRAINED)
    monkeypatch.setattr(deployments.app, "build_app", lambda cfg: None)
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)  # whatever listens on 8000/9000 here
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)  # /models/t exists nowhere
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    for keep_running in ([], ["--keep-running"]):
        calls.clear()
        assert cli.run_serve(_args("--target", "/models/t", "--draft", "none", *keep_running)) == 130
        assert calls == ["ray.init", "serve.start", "drain", "serve.shutdown", "ray.shutdown"]
        err = capsys.readouterr().err
        assert "[specdec serve] interrupted\n[specdec serve] shutting down\n" in err and "Traceback" not in err


NOTHING_DRAINED = {"replicas": 0, "in_flight": 0, "cut": 0}


@pytest.mark.parametrize("argv, grace", [([], 2.0), (["--shutdown-grace", "0.5"], 0.5)])
def test_ctrl_c_while_serving_drains_the_routers_before_serve_stops(monkeypatch, capsys, argv, grace):
    """Ctrl-C or SIGTERM on ``--keep-running`` took ~9 s (tiny pair, idle; 12 s with requests in
    flight) and cut the requests in flight without a status: Serve's shutdown kills its proxies
    at once, then stops its deployments one by one, each waiting at least its 2 s wait loop.
    Now the routers are drained first (the requests in flight get ``--shutdown-grace`` seconds,
    then UNAVAILABLE), then Serve stops, then Ray: in that order, exit 0."""
    import ray
    from ray import serve

    import deployments.app

    calls = []

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append("ray.init"))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: calls.append("ray.shutdown"))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "MetricsExportPort": 41234}])
    monkeypatch.setattr(serve, "start", lambda *a, **k: calls.append("serve.start"))
    monkeypatch.setattr(serve, "run", lambda *a, **k: calls.append("serve.run"))
    monkeypatch.setattr(serve, "get_deployment_handle", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: calls.append("serve.shutdown"))
    monkeypatch.setattr(cli, "drain_routers", lambda app, grace_s: calls.append(("drain", app, grace_s))
                        or {"replicas": 2, "in_flight": 3, "cut": 1})
    monkeypatch.setattr(cli.time, "sleep", interrupted)  # the --keep-running loop's sleep
    monkeypatch.setattr(deployments.app, "build_app", lambda cfg: None)
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    assert cli.run_serve(_args("--target", "/models/t", "--draft", "none", "--keep-running", *argv)) == 0
    assert calls == ["ray.init", "serve.start", "serve.run", ("drain", "specdec", grace), "serve.shutdown",
                     "ray.shutdown"]
    err = capsys.readouterr().err
    assert (f"[specdec serve] serving; Ctrl-C to stop\n[specdec serve] shutting down\n[specdec serve] 3 request(s) "
            f"in flight: 2 finished, 1 ended UNAVAILABLE after the {grace:g} s grace\n[specdec serve] stopped in ") in err
    assert "interrupted" not in err and "Traceback" not in err


class _Call:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def test_drain_routers_reaches_every_running_router_replica(monkeypatch):
    """A handle call reaches one replica of its choice: the drain calls go out two per running
    replica, again until every replica (by id) has answered; a call that fails is left to
    Serve's shutdown. The counts are summed once per replica."""
    import ray
    from ray import serve
    from ray.serve._private.common import ReplicaState

    answers = iter([{"replica": "a", "in_flight": 2, "cut": 1, "left": 0}] * 3 + [RuntimeError("replica died")]
                   + [{"replica": "a", "in_flight": 2, "cut": 1, "left": 0},
                      {"replica": "b", "in_flight": 1, "cut": 0, "left": 0}, {"replica": "b"}, {"replica": "a"}])
    sent = []

    class Handle:
        class Drain:
            @staticmethod
            def remote(grace_s):
                sent.append(grace_s)
                return _Call(next(answers))

    class Obj:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    status = Obj(applications={"specdec": Obj(deployments={
        "Router": Obj(replica_states={ReplicaState.RUNNING: 2, ReplicaState.STOPPING: 1})})})
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(serve, "status", lambda: status)
    monkeypatch.setattr(serve, "get_deployment_handle", lambda name, app_name: Handle())
    assert cli.drain_routers("specdec", 1.5) == {"replicas": 2, "in_flight": 3, "cut": 1}
    assert sent == [1.5] * 8
    assert cli.drain_routers("other-app", 1.5) == NOTHING_DRAINED  # no such application: nothing to drain
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert cli.drain_routers("specdec", 1.5) == NOTHING_DRAINED and len(sent) == 8


def test_demo_request_without_proposals_says_n_a_for_the_acceptance_rate(monkeypatch):
    """A demo request that never speculated (K = 0 on every step) printed "acceptance rate None"
    on its stats line; it says n/a, as ``specdec client`` does."""
    import io

    import deployments.client as client_lib
    from protos.specdec.v1 import specdec_pb2 as pb

    class Plain:
        def __init__(self, address, application="specdec", api_key=None, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stream_proto(self, request, timeout=None):
            yield pb.GenerateStreamChunk(text="ab", token_ids=[7, 8])
            yield pb.GenerateStreamChunk(text="c", token_ids=[9], stats=pb.SpeculationStats(
                steps=3, mean_accepted_length=1.0, wire_bytes_per_step=120, round_trip_s=0.05, target_compute_s=0.02))

    monkeypatch.setattr(client_lib, "SpecDecClient", Plain)
    out = io.StringIO()
    numbers = cli.demo_request("localhost:1", "specdec", "hi", 3, out=out)
    assert numbers["acceptance_rate"] is None and numbers["completion_tokens"] == 3 and numbers["steps"] == 3
    line = out.getvalue().strip().splitlines()[-1]
    assert " | acceptance rate n/a | 1.00 tokens/step over 3 steps | 120 B/step on the draft<->target wire, " \
        "round trip 50 ms (target compute 20 ms)" in line, line


def test_a_failed_demo_request_is_one_line_and_sends_the_api_key(monkeypatch, capsys):
    """With a tenants file the demo request (no key) failed UNAUTHENTICATED out of ``specdec
    serve`` as a traceback; it now sends ``$SPECDEC_API_KEY`` and a failure is one line, exit 1."""
    import ray
    from ray import serve

    import deployments.app
    import deployments.client as client_lib

    seen = []

    class Refusing:
        def __init__(self, address, application="specdec", api_key=None, **_):
            seen.append(api_key)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stream_proto(self, request, timeout=None):
            raise client_lib.Unauthenticated("UNAUTHENTICATED", "unknown API key")

    for name in ("init", "shutdown"):
        monkeypatch.setattr(ray, name, lambda *a, **k: None)
    for name in ("start", "run"):
        monkeypatch.setattr(serve, name, lambda *a, **k: None)
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: None)
    monkeypatch.setattr(deployments.app, "build_app", lambda cfg: None)
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)  # whatever listens on 8000/9000 here
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)  # /models/t exists nowhere
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    monkeypatch.setattr(client_lib, "SpecDecClient", Refusing)
    monkeypatch.setenv("SPECDEC_API_KEY", "sk-demo")
    assert cli.run_serve(_args("--target", "/models/t", "--draft", "none", "--demo-request")) == 1
    assert seen == ["sk-demo"]
    err = capsys.readouterr().err
    assert "[specdec serve] the demo request failed: UNAUTHENTICATED: unknown API key\n" in err
    assert "Traceback" not in err and "[specdec serve] shutting down" in err


@pytest.mark.parametrize("flag, port", [([], 41234), (["--metrics-port", "8123"], 8123)])
def test_serve_says_where_its_metrics_are(monkeypatch, capsys, flag, port):
    """The README points at Prometheus metrics (ray_specdec_*), but a local ``specdec serve``
    exported them on a random port it never printed; it now prints the URL, and
    ``--metrics-port`` fixes the port."""
    import ray
    from ray import serve

    import deployments.app

    inits = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append(k))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: None)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "MetricsExportPort": port}])
    for name in ("start", "run"):
        monkeypatch.setattr(serve, name, lambda *a, **k: None)
    monkeypatch.setattr(serve, "get_deployment_handle", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: None)
    monkeypatch.setattr(deployments.app, "build_app", lambda cfg: None)
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    assert cli.run_serve(_args("--target", "/models/t", "--draft", "none", *flag)) == 0
    assert inits[0].get("_metrics_export_port") == (8123 if flag else None)
    err = capsys.readouterr().err
    assert (f"[specdec serve] metrics: http://localhost:{port}/metrics  Prometheus text, specdec's are ray_specdec_* "
            "(--metrics-port sets the port)\n") in err


def test_tenants_flag_sets_the_tenants_file_and_a_bad_one_is_refused_at_once(tmp_path, monkeypatch):
    """A tenants file could only be given inside a whole AppConfig YAML (losing the local-cpu
    preset's other settings), and a bad one failed the deploy inside Ray; ``--tenants FILE``
    sets it over the preset, as an absolute path, and a bad file is a TenantConfigError before
    anything starts."""
    from specdec.control.tenants import TenantConfigError, hash_api_key

    good = tmp_path / "tenants.yaml"
    good.write_text(f"tenants:\n  - id: team-a\n    api_key_hashes: [{hash_api_key('sk-a')}]\n")
    monkeypatch.chdir(tmp_path)
    cfg = cli.load_config(_args("--tenants", "tenants.yaml"))
    assert cfg.tenants_file == str(good) and cfg.target_tp == PRESETS["local-cpu.yaml"].target_tp
    assert cfg.model_dump(exclude={"tenants_file"}) == PRESETS["local-cpu.yaml"].model_dump(exclude={"tenants_file"})
    with pytest.raises(TenantConfigError, match="cannot read tenant configuration .*missing.yaml"):
        cli.load_config(_args("--tenants", "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("tenants:\n  - id: team-a\n")
    with pytest.raises(TenantConfigError):
        cli.load_config(_args("--tenants", "bad.yaml"))
    for empty in ("", "  "):  # an unset shell variable: refused, not open mode
        with pytest.raises(TenantConfigError, match="^--tenants is empty: give the tenants file's path$"):
            cli.load_config(_args("--tenants", empty))


def test_sigint_stops_serve_even_when_started_in_the_background():
    """A shell starts ``specdec serve --keep-running &`` with SIGINT ignored, so ``kill -INT``
    (and a later Ctrl-C on a foregrounded job) did nothing; SIGINT, like SIGTERM, now raises
    KeyboardInterrupt, the way ``specdec serve`` shuts down."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job\n"
            "from deployments import cli\n"
            "cli._stop_on_sigterm()\n"
            "for sig in (signal.SIGINT, signal.SIGTERM):\n"
            "    try:\n"
            "        os.kill(os.getpid(), sig); time.sleep(5); print('ignored', sig.name)\n"
            "    except KeyboardInterrupt:\n"
            "        print('stopped', sig.name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["stopped SIGINT", "stopped SIGTERM"], out.stderr


@pytest.mark.parametrize("taken", ["http", "grpc"])
def test_serve_refuses_a_port_another_server_listens_on(taken, monkeypatch, capsys):
    """A second ``specdec serve`` on the ports of a running one started without a word: Serve's
    proxies listen with SO_REUSEPORT, so the kernel split the connections between the two and
    a greedy request got either server's answer. Now it is refused (exit 2, the port and the
    flag named) before Ray starts; the listener here uses SO_REUSEPORT as Serve's proxy does."""
    import socket

    import ray

    from specdec import cli as specdec_cli
    from tests.deployments.serving import free_port

    ports = {"http": free_port(), "grpc": free_port()}
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("0.0.0.0", ports[taken]))
    listener.listen()
    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    try:
        argv = ["serve", "--target", "/models/t", "--draft", "none",
                "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"])]
        assert specdec_cli.main(argv) == 2
    finally:
        listener.close()
    name, flag = ("HTTP", "--http-port") if taken == "http" else ("gRPC", "--grpc-port")
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"specdec: error: {name} port {ports[taken]} is already in use on this machine (another `specdec serve`?): "
        "a second server on it would share its connections, answering some requests with the other server's "
        f"models; stop that one or pass {flag} with a free port")
    assert started == []
    cli.ensure_ports_free(cli.load_config(_args("--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]))))


def test_serve_names_a_missing_model_before_starting_ray(tmp_path, monkeypatch, capsys):
    """``specdec serve --target /no/such/folder`` started Ray and Serve, then failed with Serve's
    traceback "Failed to update the deployments ['Draft']"; now the spec is checked first: one
    line naming the flag and the path, exit 2, Ray never started."""
    import ray

    from specdec import cli as specdec_cli
    from tests.deployments.serving import free_port

    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append("ray.init"))
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port())]
    missing = str(tmp_path / "no-such-model")
    assert specdec_cli.main(["serve", "--target", missing, "--draft", "none", *ports]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"specdec: error: --target: model path {missing!r} does not exist (expected a Hugging Face folder or a .gguf file)")
    assert specdec_cli.main(["serve", "--target", "demo:target", "--draft", missing + ".gguf", *ports]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"specdec: error: --draft: ")
    assert started == []


def test_a_failed_deploy_says_which_replica_failed_and_why(monkeypatch, capsys):
    """A replica that failed to start (here: a file named .gguf that is not one) ended ``specdec
    serve`` with Serve's traceback, which only named the deployment; now it is the replica's own
    error, one line per failed deployment, exit 1, and Serve and Ray are shut down."""
    from types import SimpleNamespace

    import ray
    from ray import serve

    import deployments.app

    calls = []
    replica_error = (
        "The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n"
        '  File "/x/deployments/draft.py", line 80, in __init__\n    self.target = load(cfg)\n'
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "specdec.errors.ModelLoadError: cannot load GGUF file /m/bad.gguf: /m/bad.gguf does not start with the "
        "GGUF magic bytes, so it is not a GGUF file.\n")
    status = SimpleNamespace(applications={"specdec": SimpleNamespace(deployments={
        "Router": SimpleNamespace(status="HEALTHY", message=""),
        "Draft": SimpleNamespace(status="DEPLOY_FAILED", message=replica_error),
        "Target": SimpleNamespace(status="UNHEALTHY", message=""),
    })})

    def failing(*a, **k):
        raise RuntimeError("Deploying application specdec failed: Failed to update the deployments ['Draft'].")

    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append("ray.init"))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "start", lambda *a, **k: calls.append("serve.start"))
    monkeypatch.setattr(serve, "run", failing)
    monkeypatch.setattr(serve, "status", lambda: status)
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: calls.append("serve.shutdown"))
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)
    monkeypatch.setattr(deployments.app, "build_app", lambda cfg: None)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    assert cli.run_serve(_args("--target", "/m/bad.gguf", "--draft", "none")) == 1
    assert calls == ["ray.init", "serve.start", "serve.shutdown", "ray.shutdown"]
    err = capsys.readouterr().err
    assert ("[specdec serve] the deploy failed: Deploying application specdec failed: Failed to update the "
            "deployments ['Draft'].\n"
            "[specdec serve] Draft: specdec.errors.ModelLoadError: cannot load GGUF file /m/bad.gguf: /m/bad.gguf "
            "does not start with the GGUF magic bytes, so it is not a GGUF file.\n"
            "[specdec serve] Target: UNHEALTHY\n"
            "[specdec serve] shutting down\n") in err
    assert "Traceback" not in err


def test_proxies_that_do_not_start_are_one_line_not_a_traceback(monkeypatch, capsys):
    """On a loaded machine (load 9 on 2 cores) Serve's proxy actor was not ready within Ray's fixed
    60 s (``HTTP_PROXY_TIMEOUT``), Serve killed it and ``serve.start`` raised ``ActorDiedError``:
    ``specdec serve`` ended in Ray's traceback. Now it is one line naming the cause, exit 1, and
    Serve and Ray are shut down."""
    import ray
    from ray import serve
    from ray.exceptions import ActorDiedError

    calls = []

    def dying(*a, **k):
        calls.append("serve.start")
        raise ActorDiedError()

    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append("ray.init"))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "start", dying)
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: calls.append("serve.shutdown"))
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    assert cli.run_serve(_args("--target", "/models/t", "--draft", "none")) == 1
    assert calls == ["ray.init", "serve.start", "serve.shutdown", "ray.shutdown"]
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ("[specdec serve] Serve's HTTP and gRPC proxies did not start (ActorDiedError; Ray gives them 60 s, "
            "HTTP_PROXY_TIMEOUT): is the machine overloaded? Retry once it is quieter\n"
            "[specdec serve] shutting down\n") in err, err


@pytest.mark.parametrize("env, cap", [(None, "67108864"), ("1000000", "1000000")], ids=["default", "user-set"])
def test_serve_caps_the_grpc_message_size_of_serves_proxy(monkeypatch, env, cap):
    """Serve's gRPC proxy took messages up to 2 GiB (its default): an unauthenticated 256 MB
    request was read, parsed and relayed to the router before UNAUTHENTICATED (7.8 s, the proxy at
    1.08 GB RSS), where HTTP refuses a body over ~16 MiB unread. ``specdec serve`` starts Ray with
    ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE`` 64 MiB (a value the user set wins), in its own environment
    (inherited by Ray's processes) and in the job's runtime_env, so grpcio answers a larger message
    RESOURCE_EXHAUSTED before reading it."""
    import os

    import ray
    from ray import serve

    inits = []

    def stop(*a, **k):
        raise KeyboardInterrupt

    if env is None:
        monkeypatch.delenv("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", raising=False)
    else:
        monkeypatch.setenv("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", env)
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append((os.environ.get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"), k)))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: None)
    monkeypatch.setattr(serve, "start", stop)
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: None)
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    assert cli.run_serve(_args("--target", "/models/t", "--draft", "none")) == 130
    [(seen_env, kwargs)] = inits
    assert seen_env == cap
    assert kwargs["runtime_env"]["env_vars"] == {"TOKENIZERS_PARALLELISM": "false", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": cap}
    assert cli.GRPC_MAX_MESSAGE_BYTES == 64 * 2**20


def test_tenant_stats_json_prints_current_k_zero_and_leaves_unknowns_out():
    """`specdec client --tenant-stats`: a tenant held at K = 0 showed no ``currentK`` at all
    (protobuf's JSON leaves defaults out), hiding "speculation is off"; an unset ``optional``
    field (acceptance before any evidence) stays absent: unknown, not 0."""
    import json

    from protos.specdec.v1 import specdec_pb2 as pb

    msg = pb.GetTenantStatsResponse(tenant_id="team-b", proposer=1, current_k=0)
    msg.usage.requests = 3
    out = json.loads(cli.tenant_stats_json(msg))
    assert out["currentK"] == 0 and out["tenantId"] == "team-b" and out["proposer"] == "PROPOSER_DRAFT"
    assert out["usage"]["requests"] == "3" and out["usage"]["completionTokens"] == "0"
    assert "acceptanceRate" not in out and "predictedSpeedup" not in out
    msg.acceptance_rate = 0.0
    assert json.loads(cli.tenant_stats_json(msg))["acceptanceRate"] == 0.0
    # stats: the pooled counters only; one request's fields (K counts, seconds) are not printed as 0
    msg.stats.steps, msg.stats.proposed, msg.stats.accepted = 29, 116, 100
    msg.stats.accepted_per_position.extend([29, 27, 24, 20])
    stats = json.loads(cli.tenant_stats_json(msg))["stats"]
    assert stats == {"steps": 29, "proposed": 116, "accepted": 100, "rejectedSteps": 0,
                     "acceptedPerPosition": [29, 27, 24, 20], "proposedPerPosition": []}


def test_serve_with_tenants_says_how_many_it_loaded(monkeypatch, capsys, tmp_path):
    """A new user's trial: with --tenants the start-up said nothing about the file (open mode has its
    own line); now one line names the file, the number of tenants and their ids, and no open-mode line."""
    import ray
    from ray import serve

    import deployments.app
    from specdec.control.tenants import hash_api_key

    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n" + "".join(f"  - id: team-{i}\n    api_key_hashes: [{hash_api_key(f'sk-{i}')}]\n"
                                             for i in range(10)))
    monkeypatch.setattr(ray, "init", lambda *a, **k: None)
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: None)
    monkeypatch.setattr(serve, "start", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop here")))
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: None)
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)
    monkeypatch.setattr(deployments.app, "build_app", lambda cfg: None)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    assert cli.run_serve(_args("--target", "/m/t.gguf", "--draft", "none", "--tenants", str(path))) == 1
    err = capsys.readouterr().err
    assert (f"[specdec serve] tenants from {path}: 10 (team-0, team-1, team-2, team-3, team-4, team-5, team-6, "
            "team-7, and 2 more); every request needs its tenant's API key (authorization: Bearer <key>)\n") in err
    assert "open mode" not in err
    assert cli.tenants_line(str(path), shown=2) == (f"tenants from {path}: 10 (team-0, team-1, and 8 more); every "
                                                   "request needs its tenant's API key (authorization: Bearer <key>)")


@pytest.mark.parametrize("argv, host", [((), "127.0.0.1"), (("--host", "0.0.0.0"), "0.0.0.0")])
def test_serve_http_listens_on_localhost_unless_told_and_open_mode_says_so(monkeypatch, capsys, argv, host):
    """A fresh-eyes user found `specdec serve` (open mode: no API keys) listening on 0.0.0.0:8000.
    HTTP now listens on 127.0.0.1 unless --host says otherwise; Ray Serve's gRPC proxy binds every
    interface (it has no host option), which the open-mode start line says."""
    import ray
    from ray import serve

    import deployments.app

    seen = {}

    def start(*a, **k):
        seen["host"] = k["http_options"].host
        raise RuntimeError("stop here")

    monkeypatch.setattr(ray, "init", lambda *a, **k: None)
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: None)
    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(cli, "shutdown_serve", lambda *a, **k: None)
    monkeypatch.setattr(cli, "ensure_ports_free", lambda cfg: None)
    monkeypatch.setattr(cli, "check_model_specs", lambda cfg: None)
    monkeypatch.setattr(deployments.app, "build_app", lambda cfg: None)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    assert cli.run_serve(_args("--target", "/m/t.gguf", "--draft", "none", *argv)) == 1
    assert seen == {"host": host}
    err = capsys.readouterr().err
    assert (f"[specdec serve] open mode (no --tenants): no API keys; HTTP on {host}, gRPC port 9000 on every "
            "interface (Ray Serve's gRPC proxy): firewall it or use --tenants\n") in err
