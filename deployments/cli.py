"""``specdec serve`` and ``specdec client``: argparse here, Ray and gRPC imported in the run functions.

    specdec serve --demo-request                 # local Ray, deploy the demo pair, one real gRPC request, exit
    specdec serve --keep-running                 # ... and keep serving (gRPC :9000, HTTP :8000) until Ctrl-C
    specdec serve --config deployments/local-cpu.yaml --tp 2
    specdec client --address localhost:9000 --message "user:Write a prime check in Python" --stream
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from deployments.serve_checks import check_model_specs, deploy_failures, ensure_ports_free
from deployments.serve_config import load_config
from specdec.cli import Command

DEMO_MESSAGE = "Write a Python function that checks whether a number is prime."
#: ``--shutdown-grace``: seconds the requests in flight have to finish after Ctrl-C / SIGTERM
#: (short: a user's Ctrl-C wants a prompt stop; ``docker stop`` waits 10 s before SIGKILL).
DEFAULT_SHUTDOWN_GRACE_S = 2.0
#: Largest gRPC message (bytes) Serve's gRPC proxy reads, set as ``RAY_SERVE_GRPC_MAX_MESSAGE_SIZE``
#: (Serve's default: 2 GiB) unless the environment sets it: a larger request is answered
#: RESOURCE_EXHAUSTED by grpcio before it is read, parsed or relayed (a request is authenticated only
#: at the router). 64 MiB holds any prompt that fits a 32k context (at most ~8 MiB of text) with a
#: ``logit_bias`` entry per vocabulary id, as the HTTP API's body limit does (~16 MiB and up).
GRPC_MAX_MESSAGE_BYTES = 64 * 2**20


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specdec serve``."""
    parser.add_argument("--config", help="AppConfig YAML, or a Serve config file such as deployments/local-cpu.yaml "
                        "(default: the local-cpu preset)")
    parser.add_argument("--target", help="target model spec (default: the config's, demo:target)")
    parser.add_argument("--draft", help="draft model spec, or 'none' (default: the config's, demo:draft)")
    parser.add_argument("--tp", type=int, help="tensor-parallel degree of the target (default: the config's)")
    parser.add_argument("--draft-vocab-subset", type=int, default=None, metavar="N",
                        help="the draft scores only the N most frequent token ids (FR-Spec); 0: the full "
                             "vocabulary (default: the config's draft_vocab_subset)")
    parser.add_argument("--draft-vocab-table", default=None, metavar="FILE",
                        help="token frequency table of the draft vocabulary subset (default: the config's)")
    parser.add_argument("--grpc-port", type=int, help="gRPC port (default: the config's, 9000)")
    parser.add_argument("--http-port", type=int, help="HTTP port (default: the config's, 8000)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface the HTTP API listens on (default: 127.0.0.1, this machine only; 0.0.0.0: "
                             "every interface). Ray Serve's gRPC proxy listens on every interface whatever this "
                             "says: without --tenants (open mode, no API keys) firewall its port")
    parser.add_argument("--tenants", metavar="FILE", help="tenants YAML (API key hashes, limits, speculation "
                        "policy; see README 'Tenants'); default: the config's tenants_file (without one: "
                        "open mode, no API keys)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: this machine's)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="port of the local Ray's Prometheus metrics (ray_specdec_* and Ray's own) at "
                             "http://localhost:PORT/metrics (default: a free port Ray picks; printed once ready)")
    parser.add_argument("--demo-request", action="store_true",
                        help="once ready, send one code-writing request over gRPC and print answer and stats")
    parser.add_argument("--message", default=DEMO_MESSAGE, help=f"the demo request's user message (default: {DEMO_MESSAGE!r})")
    parser.add_argument("--max-tokens", type=int, default=128, help="the demo request's max_tokens (default: 128)")
    parser.add_argument("--keep-running", action="store_true", help="keep serving until Ctrl-C")
    parser.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE_S, metavar="SECONDS",
                        help="on Ctrl-C or SIGTERM, the seconds the requests in flight have to finish before "
                             "they end with UNAVAILABLE (new ones get UNAVAILABLE at once) "
                             f"(default: {DEFAULT_SHUTDOWN_GRACE_S:g})")


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``specdec client``."""
    parser.add_argument("prompt", nargs="?", help="prompt text (or use --message)")
    parser.add_argument("--address", default="localhost:9000", help="gRPC address (host:port; default: localhost:9000)")
    parser.add_argument("--application", default="specdec", help="Serve application name (default: specdec)")
    parser.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"), help="tenant API key ($SPECDEC_API_KEY)")
    parser.add_argument("--message", action="append", default=[], metavar="ROLE:TEXT", help="chat message, repeatable")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="most tokens to generate; the prompt plus this must fit the target's context "
                             "(default: the server's, 128, cut short at the context)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: 1, off)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (default: 0, off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed of a sampled request, 0..2**64-1 (default: the server draws one)")
    parser.add_argument("--stop", action="append", default=[], help="stop string, repeatable")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below MIN_P x the top probability")
    parser.add_argument("--repetition-penalty", type=float, default=None, help="over prompt and output (1: off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS to the logit of token ID (repeatable)")
    parser.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token before this many tokens")
    parser.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                        help="with --logprobs: the target's N most likely tokens per position (--json shows them)")
    parser.add_argument("--proposer", choices=["draft", "ngram", "none"], default=None,
                        help="draft model, prompt lookup or plain decoding (default: the tenant's, else the server's)")
    parser.add_argument("-k", "--k", type=int, default=None, help="largest K per step (default: the server's)")
    parser.add_argument("--draft-min-confidence", type=float, default=None, metavar="C",
                        help="end a draft block after a token whose draft probability is below C")
    parser.add_argument("--session-id", default=None, help="session id (sticky routing)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")
    parser.add_argument("--logprobs", action="store_true", help="return the target's log-probabilities")
    parser.add_argument("--json", action="store_true",
                        help="print the whole response as JSON (the shape of `specdec generate --json`, plus 'wire')")
    parser.add_argument("--tenant-stats", action="store_true", help="print the caller's tenant statistics instead")


# --- serve -------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[specdec serve] {msg}", file=sys.stderr, flush=True)


def demo_request(address: str, application: str, message: str, max_tokens: int, out=sys.stdout,
                 api_key: str | None = None) -> dict:
    """Send one chat request over gRPC (streamed), print the answer and a stats line; return the numbers.

    ``api_key``: a tenant's key, needed when the config has a tenants file (default
    ``$SPECDEC_API_KEY``, as ``specdec client``'s).

    Raises:
        deployments.client.SpecDecError: the call failed (e.g. Unauthenticated without a key).
    """
    from deployments.client import SpecDecClient, build_request

    key = api_key if api_key is not None else os.environ.get("SPECDEC_API_KEY")
    with SpecDecClient(address, application=application, api_key=key) as client:
        print(f">>> {message}\n", file=out, flush=True)
        t0 = time.perf_counter()
        first = None
        tokens = 0
        last = None
        request = build_request(messages=[{"role": "user", "content": message}], max_tokens=max_tokens)
        for chunk in client.stream_proto(request, timeout=600):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            tokens += len(chunk.token_ids)
            print(chunk.text, end="", file=out, flush=True)
            last = chunk
        wall = time.perf_counter() - t0
    s = last.stats
    rate = s.acceptance_rate if s.HasField("acceptance_rate") else None
    numbers = {
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "time_to_first_token_s": first,
        "acceptance_rate": rate,
        "mean_accepted_length": s.mean_accepted_length if s.HasField("mean_accepted_length") else None,
        "steps": s.steps,
        "wire_bytes_per_step": s.wire_bytes_per_step,
        "round_trip_ms": s.round_trip_s * 1000,
        "target_compute_ms": s.target_compute_s * 1000,
    }
    print("\n", file=out)
    print(
        f"-- {tokens} tokens in {wall:.1f} s = {numbers['tokens_per_s']:.2f} tokens/s over gRPC | "
        f"acceptance rate {'n/a' if rate is None else f'{rate:.2f}'} | "
        f"{numbers['mean_accepted_length'] or 0:.2f} tokens/step over {s.steps} steps | "
        f"{s.wire_bytes_per_step:.0f} B/step on the draft<->target wire, round trip {numbers['round_trip_ms']:.0f} ms "
        f"(target compute {numbers['target_compute_ms']:.0f} ms)",
        file=out, flush=True,
    )
    return numbers


def metrics_line(host: str = "localhost") -> str:
    """Where the local Ray serves its Prometheus metrics (``ray_specdec_*`` among them), as
    ``specdec serve`` prints it once ready; the port is the node's, as Ray reports it."""
    import ray

    try:
        ports = [n.get("MetricsExportPort") for n in ray.nodes() if n.get("Alive")]
    except Exception as e:  # noqa: BLE001 - a line to print; serving goes on
        return f"metrics: unknown ({type(e).__name__}: {e})"
    return (f"metrics: http://{host}:{ports[0]}/metrics  Prometheus text, specdec's are ray_specdec_* "
            "(--metrics-port sets the port)") if ports and ports[0] else "metrics: none (Ray reports no metrics port)"


def endpoint_lines(cfg, host: str = "localhost") -> list[str]:
    """The two ways to call a served application, as ``specdec serve`` prints them."""
    return [
        f"gRPC:  {host}:{cfg.grpc_port}  service specdec.v1.SpecDec, metadata application={cfg.app_name} "
        "(health and reflection on the same port)",
        f"HTTP:  http://{host}:{cfg.http_port}/{cfg.app_name}/v1  OpenAI API: /models, /completions, "
        f"/chat/completions (model \"{cfg.app_name}\")",
    ]


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a container stop) and SIGINT shut down like Ctrl-C: Serve, then the
    local Ray with all its processes. Installed after ``ray.init``, whose own handler would
    otherwise exit the driver and leave Ray's agent processes running. SIGINT too because a
    shell starts a background job (``specdec serve --keep-running &``) with SIGINT ignored, and
    Python then installs no Ctrl-C handler: ``kill -INT`` did nothing."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def tenants_line(path: str, shown: int = 8) -> str:
    """``specdec serve``'s line for a tenants file: how many tenants it holds, the first ``shown`` ids.

    Raises:
        specdec.control.tenants.TenantConfigError: the file cannot be read or is not a valid tenants
            file (:func:`deployments.serve_config.load_config` has checked it before).
    """
    from specdec.control.tenants import load_tenants_config

    ids = [t.id for t in load_tenants_config(path).tenants]
    listed = ", ".join(ids[:shown]) + (f", and {len(ids) - shown} more" if len(ids) > shown else "")
    return (f"tenants from {path}: {len(ids)} ({listed}); every request needs its tenant's API key "
            "(authorization: Bearer <key>)")


def start_line(cfg, num_cpus: int, capability: str | None = None) -> str:
    """``specdec serve``'s first line: the models, their weight formats (the ones the replicas will load), the
    local Ray's CPUs and torch's CPU kernel level (``capability``: default
    ``torch.backends.cpu.get_cpu_capability()``, e.g. ``"AVX512"``, ``"AVX2"``).

    On a CPU where torch has neither AVX-512 nor AVX2 kernels the CPU default is float32
    (:func:`specdec.models.formats.choose_cpu_format`; AVX2 gets int4 since session 12): the line says so,
    since float32 takes ~9 GiB for the demo pair and a verify of several positions costs several
    one-position forwards, so K under load mostly stays at 0 (docs/bench/served-w8a8/FIRST-s12-first12.md).
    """
    on_gpu = cfg.target_gpus_per_worker > 0
    target_fmt = cfg.target_format()
    models = f"target {cfg.target_model} (TP={cfg.target_tp}, {target_fmt})"
    if cfg.draft_model:
        draft_fmt = cfg.draft_format("cuda" if cfg.draft_num_gpus > 0 else "cpu")
        models += f", draft {cfg.draft_model} ({draft_fmt})"
    else:
        models += ", no draft"
    line = f"{models}; local Ray with {num_cpus} CPUs"
    if on_gpu:
        return line
    if capability is None:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    line += f", CPU kernels {capability}"
    if target_fmt == "float32" and not cfg.target_dtype and not capability.upper().startswith(("AVX512", "AVX2")):
        line += " (no AVX2 or AVX-512: float32 weights, the quantized formats need them)"
    return line


#: what each attention mode of the target's TP ranks (their ``Info``'s ``"attention"``) means, for the start-up line
ATTENTION_MODES = {
    "row": "one attention call per query row",
    "sequence": "one attention call per sequence (its load-time probe passed)",
    "transformers": "transformers' attention (a forward not made shape-invariant)",
}


def target_line(infos: list[dict]) -> str:
    """``specdec serve``'s line on the running target replica, from its TP ranks' ``Info`` facts:
    ranks, device, weight format, torch threads and how attention computes rows (on a GPU one
    call per row is launch-bound: session 22 measured the batched path 10x slower than the
    unbatched one there; README, "What has not run on a GPU yet").

    Args:
        infos: one dict per rank (:meth:`deployments.tp_worker.TPWorker.setup`'s facts), rank 0 first.

    Returns:
        e.g. ``"target replica: TP=1 on cpu, w8a8, 2 torch threads, one attention call per query row"``.
    """
    if not infos:
        return "target replica: no TP rank reported"
    first = infos[0]
    mode = first.get("attention")
    return (f"target replica: TP={len(infos)} on {first.get('device')}, {first.get('weight_format')}, "
            f"{first.get('torch_threads')} torch threads, {ATTENTION_MODES.get(mode, f'attention {mode}')}")


def run_serve(args) -> int:
    """Start a local Ray, deploy, wait until ready; optionally send the demo request; shut down.

    Returns:
        The exit status: 0 done (or stopped by Ctrl-C/SIGTERM while serving), 1 Serve's proxies did
        not start, the deploy failed or the demo request failed (one line each, no traceback), 130
        interrupted before ready.
    """
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import build_app
    from deployments.config import HEALTH_SERVICER, SPECDEC_SERVICER

    cfg = load_config(args)
    ensure_ports_free(cfg)
    check_model_specs(cfg)
    num_cpus = args.num_cpus or os.cpu_count() or 2  # load_config refused --num-cpus < 1
    _log(start_line(cfg, num_cpus))
    if not cfg.tenants_file:
        _log(f"open mode (no --tenants): no API keys; HTTP on {getattr(args, 'host', None) or '127.0.0.1'}, "
             f"gRPC port {cfg.grpc_port} on every interface (Ray Serve's gRPC proxy): firewall it or use --tenants")
    else:
        _log(tenants_line(cfg.tenants_file))
    if cfg.target_model.startswith("demo") or (cfg.draft_model or "").startswith("demo"):
        from specdec.models.demo import ensure_demo_folder

        from specdec.models.formats import storage_dtype

        t0 = time.perf_counter()
        fmts = {"target": cfg.target_format(), "draft": cfg.draft_format()}
        for role in ("target", "draft"):
            # the folder the role's format loads from (bfloat16 for int4): assembled once per cache
            ensure_demo_folder(role, dtype=storage_dtype(fmts[role]))
        _log(f"demo pair ready in the model cache ({time.perf_counter() - t0:.1f} s)")
    metrics = {"_metrics_export_port": args.metrics_port} if getattr(args, "metrics_port", None) else {}
    # read by Serve's proxy at import: in this environment (Ray's processes inherit it) and the job's
    grpc_cap = os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(GRPC_MAX_MESSAGE_BYTES))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": grpc_cap}},
             **metrics)
    _stop_on_sigterm()
    serving = False
    try:
        try:
            serve.start(
                http_options=HTTPOptions(host=getattr(args, "host", None) or "127.0.0.1", port=cfg.http_port),
                grpc_options=gRPCOptions(port=cfg.grpc_port, grpc_servicer_functions=[SPECDEC_SERVICER, HEALTH_SERVICER],
                                         request_timeout_s=cfg.request_timeout_s),
            )
        except Exception as e:  # noqa: BLE001 - e.g. ActorDiedError: the proxy missed Ray's fixed 60 s on a loaded machine
            _log(f"Serve's HTTP and gRPC proxies did not start ({type(e).__name__}; Ray gives them 60 s, "
                 "HTTP_PROXY_TIMEOUT): is the machine overloaded? Retry once it is quieter")
            return 1
        t0 = time.perf_counter()
        _log("deploying Router, Draft, Target (loading the models) ...")
        try:
            serve.run(build_app(cfg), name=cfg.app_name, route_prefix=f"/{cfg.app_name}")
        except RuntimeError as e:  # a replica failed to start: say why in a few lines, not Serve's traceback
            _log(f"the deploy failed: {e}")
            for line in deploy_failures(cfg.app_name):
                _log(line)
            return 1
        address = f"localhost:{cfg.grpc_port}"
        # the draft replica's start-up calibration of K under load (deployments.draft_calibration)
        try:
            serve.get_deployment_handle("Draft", app_name=cfg.app_name).calibrate.remote().result(
                timeout_s=cfg.request_timeout_s)
        except Exception as e:  # noqa: BLE001 - requests say what is wrong; serving goes on
            _log(f"the draft replica is not ready yet: {type(e).__name__}: {e}")
        _log(f"ready in {time.perf_counter() - t0:.1f} s")
        try:  # the replica's own facts (how its attention computes rows, above all on a GPU)
            _log(target_line(serve.get_deployment_handle("Target", app_name=cfg.app_name).Info.remote().result(
                timeout_s=10)))
        except Exception as e:  # noqa: BLE001 - a line for the operator only; serving goes on
            _log(f"target replica: its facts are not available ({type(e).__name__})")
        for line in endpoint_lines(cfg):
            _log(line)
        _log(metrics_line())
        if args.demo_request:
            from deployments.client import SpecDecError

            try:
                demo_request(address, cfg.app_name, args.message, args.max_tokens)
            except SpecDecError as e:  # e.g. a tenants file and no $SPECDEC_API_KEY: a line, not a traceback
                _log(f"the demo request failed: {e}")
                return 1
        if args.keep_running:
            serving = True  # before the line: a Ctrl-C right after it is the normal stop (exit 0)
            _log("serving; Ctrl-C to stop")
            while True:
                time.sleep(3600)
        return 0
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the way to stop --keep-running; earlier, no traceback
        if serving:
            return 0
        _log("interrupted")
        return 130
    finally:
        _log("shutting down")
        t_stop = time.perf_counter()
        grace_s = getattr(args, "shutdown_grace", DEFAULT_SHUTDOWN_GRACE_S)
        try:
            drained = drain_routers(cfg.app_name, grace_s)
            if drained["in_flight"]:
                _log(f"{drained['in_flight']} request(s) in flight: {drained['in_flight'] - drained['cut']} finished, "
                     f"{drained['cut']} ended UNAVAILABLE after the {grace_s:g} s grace")
            shutdown_serve()
        finally:
            ray.shutdown()
            _log(f"stopped in {time.perf_counter() - t_stop:.1f} s")


def drain_routers(app_name: str, grace_s: float, extra_s: float = 5.0) -> dict:
    """Drain every Router replica of ``app_name`` (:meth:`deployments.router.Router.Drain`)
    before Serve stops: new requests get UNAVAILABLE, those in flight have ``grace_s`` seconds to
    finish, the rest end with UNAVAILABLE. Serve's own shutdown would instead kill its proxies at
    once, cutting every open connection without a status (an HTTP stream ended mid-chunk).

    A handle call reaches one replica, so the calls go out two per running replica, again until
    each replica (by id) has answered or ``grace_s + extra_s`` seconds have passed. Nothing
    happens when Serve or the application is not running.

    Returns:
        ``{"replicas": replicas drained, "in_flight": requests in flight when the drain began,
        "cut": those ended with UNAVAILABLE}`` (zeros when there was nothing to drain).
    """
    import ray
    from ray import serve

    out = {"replicas": 0, "in_flight": 0, "cut": 0}
    if not ray.is_initialized():  # serve.status() would start a local Ray just to find nothing
        return out
    try:
        app = serve.status().applications.get(app_name)
        dep = app.deployments.get("Router") if app is not None else None
        # replica_states is keyed by ReplicaState, a str enum: "RUNNING" finds its count
        running = int(dep.replica_states.get("RUNNING", 0)) if dep is not None else 0
        if not running:
            return out
        handle = serve.get_deployment_handle("Router", app_name=app_name)
    except Exception:  # noqa: BLE001 - no Serve, no application: nothing to drain
        return out
    seen: dict[str, dict] = {}
    end = time.monotonic() + grace_s + extra_s
    while len(seen) < running and time.monotonic() < end:
        calls = [handle.Drain.remote(grace_s) for _ in range(2 * running)]
        for call in calls:
            try:
                got = call.result(timeout_s=max(0.1, end - time.monotonic()))
            except Exception:  # noqa: BLE001 - a replica that died or did not answer: Serve stops it
                continue
            seen.setdefault(got["replica"], got)
    out["replicas"] = len(seen)
    out["in_flight"] = sum(d["in_flight"] for d in seen.values())
    out["cut"] = sum(d["cut"] for d in seen.values())
    return out


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """Shut Serve down on this driver's Ray cluster, as ``serve.shutdown()`` does, without the
    line "(raylet) Task ServeController.graceful_shutdown failed ... killed by `ray.kill`".

    ``serve.shutdown()`` calls the controller's ``graceful_shutdown(wait=True)``, which by design
    never returns: the caller waits until the controller kills itself, so that task always ends
    failed and Ray prints the failure. Here the flag is set with ``wait=False`` (the task returns
    at once) and the controller's end is awaited by looking its name up, which asks the GCS, not
    the actor. Nothing happens when Serve was never started.

    Args:
        timeout_s: how long to wait for the controller to go, in seconds (then it is left to
            ``ray.shutdown()``).
    """
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve.context import _disconnect

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # no Serve on this cluster
        return
    try:
        ray.get(controller.graceful_shutdown.remote(False), timeout=timeout_s)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            time.sleep(0.1)
        _log(f"Serve's controller did not stop within {timeout_s:.0f} s; stopping Ray")
    except ValueError:  # the name is gone: the controller stopped every application and itself
        pass
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass
    finally:
        _disconnect()


# --- client ------------------------------------------------------------------------------------


def run_client(args) -> int:
    """Call a running server; print the answer (or JSON), errors as ``CODE: details`` (exit 1)."""
    from deployments.client import SpecDecClient, SpecDecError, build_request
    from deployments.client_flags import flag_problem, timeout_problem

    if timeout_problem(args.timeout):
        print(f"specdec client: {timeout_problem(args.timeout)}", file=sys.stderr)
        return 2
    with SpecDecClient(args.address, application=args.application, api_key=args.api_key,
                       session_id=args.session_id) as client:
        try:
            if args.tenant_stats:
                timeout = 30.0 if args.timeout is None else args.timeout
                print(tenant_stats_json(client.tenant_stats(args.proposer, timeout=timeout)))
                return 0
            try:
                kwargs = request_kwargs(args)
            except SpecDecError as e:  # a malformed --logit-bias: a usage error like any bad flag
                print(f"specdec client: {e.details}", file=sys.stderr)
                return 2
            if args.prompt is not None and args.message:
                print("specdec client: give a prompt or --message, not both (the prompt would be ignored)",
                      file=sys.stderr)
                return 2
            msgs = None
            if args.message:
                msgs = []
                for m in args.message:
                    role, sep, text = m.partition(":")
                    if not sep:
                        print(f"specdec client: --message must be ROLE:TEXT, got {m!r}", file=sys.stderr)
                        return 2
                    msgs.append({"role": role, "content": text})
            elif not args.prompt:
                print("specdec client: give a prompt or --message", file=sys.stderr)
                return 2
            problem = flag_problem(args)  # named by flag, nothing sent
            if problem:
                print(f"specdec client: {problem}", file=sys.stderr)
                return 2
            request = build_request(args.prompt, messages=msgs, **kwargs)
            t0 = time.perf_counter()
            if args.stream and not args.json:
                last = None
                n = 0
                for chunk in client.stream_proto(request, timeout=args.timeout):
                    print(chunk.text, end="", flush=True)
                    n += len(chunk.token_ids)
                    last = chunk
                print()
                stats = last.stats
            else:
                resp = client.generate_proto(request, timeout=args.timeout)
                if args.json:
                    print(json.dumps(_served_json(resp, time.perf_counter() - t0), indent=2))
                    return 0
                print(resp.text)
                n, stats = len(resp.token_ids), resp.stats
            wall = time.perf_counter() - t0
            rate = f"{stats.acceptance_rate:.2f}" if stats.HasField("acceptance_rate") else "n/a"
            print(f"\n-- {n} tokens in {wall:.2f} s ({n / wall:.2f} tokens/s), acceptance rate {rate}, "
                  f"{stats.wire_bytes_per_step:.0f} B/step, round trip {stats.round_trip_s * 1000:.0f} ms",
                  file=sys.stderr)
            return 0
        except SpecDecError as e:
            hint = ""
            if getattr(e, "code", None) == "UNAUTHENTICATED" and not args.api_key:
                hint = " (give the key with --api-key or $SPECDEC_API_KEY)"
            print(f"specdec client: {e}{hint}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # leaving the `with` closes the channel: the server cancels
            print("\nspecdec client: cancelled", file=sys.stderr)
            return 130


def tenant_stats_json(msg) -> str:
    """``specdec client --tenant-stats``' output: a ``GetTenantStatsResponse`` as JSON with every
    field without presence printed at its value, zeros included (protobuf's JSON leaves a field
    at its default out, so ``currentK`` 0, speculation off, the state an operator most needs to
    see, was missing); an ``optional`` field unset (``acceptanceRate`` before any evidence,
    ``predictedSpeedup`` under K under load) stays absent: unknown, not 0. ``stats`` shows only the
    pooled counters GetTenantStats fills (:data:`TENANT_STATS_FIELDS`): the rest of that message's
    fields are one request's (K counts, draft / verify / round-trip seconds, cost terms) and printed at 0
    they read as measurements (a new user's trial)."""
    import json

    from google.protobuf import json_format

    out = json_format.MessageToDict(msg, always_print_fields_with_no_presence=True)
    if "stats" in out:
        out["stats"] = {k: v for k, v in out["stats"].items() if k in TENANT_STATS_FIELDS}
    return json.dumps(out, indent=2)


#: ``SpeculationStats`` fields (JSON names) a ``GetTenantStatsResponse``'s ``stats`` holds: the tenant's
#: pooled counters (:func:`deployments.ingress.tenant_stats.tenant_stats_to_proto`).
TENANT_STATS_FIELDS = frozenset({"steps", "proposed", "accepted", "rejectedSteps", "acceptanceRate",
                                 "meanAcceptedLength", "acceptedPerPosition", "proposedPerPosition"})


def request_kwargs(args) -> dict:
    """The :func:`deployments.client.build_request` keyword arguments of ``specdec client``'s flags.

    Raises:
        InvalidArgument: a ``--logit-bias`` that is not ``ID=BIAS``.
    """
    from deployments.client import InvalidArgument

    bias: dict[int, float] = {}
    for item in args.logit_bias:
        tid, sep, value = item.partition("=")
        try:
            bias[int(tid)] = float(value)
        except ValueError:
            raise InvalidArgument("INVALID_ARGUMENT", f"--logit-bias must be ID=BIAS, got {item!r}") from None
        if not sep:
            raise InvalidArgument("INVALID_ARGUMENT", f"--logit-bias must be ID=BIAS, got {item!r}")
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop, proposer=args.proposer, max_k=args.k,
                draft_min_confidence=args.draft_min_confidence, logprobs=args.logprobs, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, logit_bias=bias, min_tokens=args.min_tokens,
                top_logprobs=args.top_logprobs)


def _served_json(resp, wall_s: float) -> dict:
    """A GenerateResponse as the plain data ``specdec generate --json`` prints, plus the wire numbers."""
    from deployments import convert

    out = convert.result_from_proto(resp, want_logprobs=bool(resp.logprobs)).as_dict()
    s = resp.stats
    out["elapsed_s"] = wall_s
    out["wire"] = {"bytes_per_step": s.wire_bytes_per_step, "round_trip_s": s.round_trip_s,
                   "target_compute_s": s.target_compute_s}
    return out



#: ``specdec serve`` and ``specdec client``, registered in the ``specdec.commands`` entry-point
#: group (pyproject.toml); the core CLI never imports this module by name.
SERVE = Command(help="serve on a local Ray (Ray Serve: gRPC and the OpenAI HTTP API)", add_arguments=add_serve_arguments, run=run_serve)
CLIENT = Command(help="call a running server over gRPC", add_arguments=add_client_arguments, run=run_client)
