"""The one configuration of the Serve application, and the Serve config built from it.

:class:`AppConfig` is validated once (pydantic) and is the only source of every number in the
Serve config files: :func:`to_serve_config` turns it into the dict Ray Serve's
``serve deploy``/``serve run CONFIG`` and KubeRay's ``serveConfigV2`` read, and
``python -m deployments.write_configs`` writes ``deployments/local-cpu.yaml`` and
``deployments/gpu.yaml`` from :data:`PRESETS` (a test checks they are up to date).

The same AppConfig is passed as the application's ``args`` to :func:`deployments.app.build_app`,
which applies the same deployment options in code, so ``serve run deployments.app:build_app``
without a config file gives the same placement.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specdec.models.spec import WeightFormat
from specdec.request import MAX_SPECULATION_LENGTH

#: Import path of the public servicer, registered in Ray Serve's gRPC proxy (the generated
#: registration with requests that always decode: undecodable bytes become INVALID_ARGUMENT).
SPECDEC_SERVICER = "deployments.servicer.add_specdec_servicer"
#: Import path of the standard grpc.health.v1 servicer (see deployments/health.py).
HEALTH_SERVICER = "deployments.health.add_health_servicer"
#: Deployments deployments.app.build_app creates.
BUILT = ("Router", "Draft", "Target")
#: Serve's experimental session-affine router (Ray >= ~2.56; checked on 2.60).
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"
#: ``graceful_shutdown_wait_loop_s`` of every deployment, seconds: how often a stopping replica
#: checks whether its requests have ended. Serve's default, 2 s, is also the least a stopping
#: replica waits, and Serve stops the application's three deployments one after another: 6 of
#: the ~9 s ``specdec serve`` took to stop on Ctrl-C (tiny pair, idle; docs/bench/harden-s14).
#: ``graceful_shutdown_timeout_s`` (how long the requests in flight may run on, 20 s) stays Serve's.
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2


class Scaling(BaseModel):
    """Replica count (fixed when min == max) and Serve autoscaling of one deployment."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(4, gt=0, description="per replica, for the autoscaler")
    max_ongoing_requests: int = Field(8, ge=1, description="per replica; further requests queue")
    upscale_delay_s: float = Field(30, ge=0)
    downscale_delay_s: float = Field(600, ge=0, description="long: downscaling moves sticky sessions")

    @model_validator(mode="after")
    def _range(self) -> "Scaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self

    def serve_options(self, autoscale: bool) -> dict[str, Any]:
        """``num_replicas`` or ``autoscaling_config``, plus ``max_ongoing_requests``."""
        out: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests}
        if autoscale and self.min_replicas != self.max_replicas:
            out["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
            }
        else:
            out["num_replicas"] = self.max_replicas
        return out


#: OpenMP wait policy of the model processes (draft replicas, TP ranks): idle OpenMP threads
#: sleep instead of spinning. libgomp's default spins an idle thread (GOMP_SPINCOUNT
#: 300000 pauses) after every parallel region; served, the draft replica and the target's TP rank
#: each hold a team of two threads on the same two cores, and whichever process is idle spins
#: against the one computing. Measured (demo pair, both w8a8, served main job, 128 tokens, one
#: locked run, machine shared): target compute 1236 ms per step with the default, 317 ms with
#: PASSIVE (docs/history/serving.md, "Served w8a8 and the default pair").
OMP_WAIT_POLICY = "PASSIVE"

#: libgomp spin count beside :data:`OMP_WAIT_POLICY` (``AppConfig.omp_spin_count``'s default;
#: an explicit GOMP_SPINCOUNT overrides PASSIVE's zero): 0, no spin. Measured on a 2-core Zen 3
#: (w7a8 pair): in one process alone, 30000 pauses made the draft's one-position forward
#: 46-48 ms against 55-68 ms without a spin (every parallel region wakes its team from a futex);
#: served (the local preset: draft replica and TP rank on the same two cores), 0 was faster at
#: every client count in one interleaved run (1 client batched 9.52 vs 8.41 tok/s, 8 clients
#: 32.0 vs 28.5, and more tokens per CPU second): the spinning threads of one process take the
#: cores the other one computes on (README, "OpenMP threads of the model processes"). A spin
#: pays where every model process has cores of its own.
OMP_SPIN_COUNT = 0


class AppConfig(BaseModel):
    """Everything that shapes the specdec Serve application."""

    model_config = ConfigDict(extra="forbid")
    app_name: str = Field("specdec", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                          description="Serve application name = gRPC `application` metadata, the HTTP route "
                                      "prefix and part of the shared controller actor's name: letters, digits, "
                                      "'.', '_', '-' (at most 64, a letter or digit first)")
    target_model: str = Field("demo:target", description="model spec (specdec.models.spec.parse_model_spec)")
    draft_model: str | None = Field("demo:draft", description="model spec, or None for no draft model")
    # draft replica: fits on a small GPU (fractional) or runs on CPU
    draft_num_gpus: float = Field(0.0, ge=0, le=8)
    draft_num_cpus: float = Field(0.25, gt=0)
    # target replica: owns target_tp worker actors in its placement group
    target_tp: int = Field(1, ge=1, le=64, description="tensor-parallel degree of the target")
    target_gpus_per_worker: float = Field(0.0, ge=0, le=1, description="0 on CPU (gloo), 1 on GPUs (nccl)")
    target_cpus_per_worker: float = Field(0.5, gt=0)
    target_replica_cpus: float = Field(0.25, gt=0, description="the replica actor itself (bundle 0)")
    router_num_cpus: float = Field(0.25, gt=0)
    router: Scaling = Field(default_factory=lambda: Scaling(min_replicas=1, max_replicas=2))
    draft: Scaling = Field(default_factory=Scaling)
    target: Scaling = Field(default_factory=Scaling)
    grpc_port: int = Field(9000, ge=1, le=65535)
    http_port: int = Field(8000, ge=1, le=65535)
    request_timeout_s: float = Field(300, gt=0)
    default_max_k: int = Field(4, ge=0, le=MAX_SPECULATION_LENGTH)
    # continuous batching (issue 10)
    target_batching: bool = Field(
        True, description="verify the blocks of concurrent sessions in one batched target forward; "
        "False: every block alone (batch size 1)",
    )
    draft_batching: bool = Field(
        True, description="draft for all sessions of a draft replica in one batched forward per draft position",
    )
    max_batch_positions: int = Field(
        64, ge=1, le=65536, description="positions budget of one batched target forward, sum of (K_i + 1) plus "
        "prefill chunks; a new prompt is prefilled in chunks within it",
    )
    batch_window_s: float = Field(
        0.002, ge=0, le=1, description="seconds the target waits after a block arrives for others to join its forward",
    )
    batch_fill_wait_s: float = Field(
        1.0, ge=0, le=60, description="fill the target's batched forwards: while blocks wait, the target also "
        "waits for the sessions it answered recently and expects back (each for at most twice the replica's median "
        "answer-to-next-block gap), at most this many seconds after the first waiting block arrived; 0: only "
        "batch_window_s (sessions that drafted at different times then alternate between half-full forwards)",
    )
    admission_slots: int | None = Field(
        None, ge=1, le=100000,
        description="requests one router replica lets into the batch at once (fair-admission slots); the rest "
        "wait in the router's per-tenant fair queue (weighted by batch_weight). None: the draft replica's "
        "max_ongoing_requests (the sessions a draft replica steps at once), at most the router's",
    )
    startup_calibration_repeats: int = Field(
        0, ge=0, le=16, description="before a draft replica reports ready it times its draft forwards and the "
        "target's verify forwards at each K up to default_max_k, this many steps per K, on a fixed prompt "
        "(deployments.draft_calibration), so a fresh server's first request is priced from measurements; 0: off",
    )
    served_batch_k: bool = Field(
        True, description="K under load: the draft replica chooses each adaptive request's K per step from the "
        "batch it runs in (specdec.control.batch_k); False: the router's per-request K holds for every step",
    )
    batch_k_goodput_guard: bool = Field(
        True, description="K under load: compare the measured goodput (tokens per step-second) of the adaptive "
        "steps when the cost model speculates against K = 0 (explored now and then) and force K = 0 while "
        "speculation measures slower (specdec.control.batch_k.GoodputGuard); False: the cost model alone",
    )
    batch_k_sync_s: float = Field(
        5.0, ge=0, le=3600, description="K under load with several draft replicas: seconds between two "
        "exchanges of a draft replica's acceptance counts with the shared controller actor, which pools "
        "every replica's steps per tenant (costs and K stay per replica); 0: each replica learns alone",
    )
    draft_prefill_chunk: int = Field(
        64, ge=1, le=65536, description="chunked draft prefill: uncached prompt positions the draft replica feeds "
        "per batched drafting round; a longer new prompt is prefilled in chunks while the other sessions keep drafting",
    )
    prefix_cache_entries: int = Field(
        8, ge=0, le=4096,
        description="automatic prefix caching (specdec.engine.prefix_cache): a new session's KV cache starts "
        "from the longest committed prefix another session of the same model holds (one still open, or one of "
        "the last prefix_cache_entries closed ones, least recently used first out), on the target's every TP rank "
        "and on the draft replica; outputs are unchanged. Memory: at most this many closed sessions' caches per "
        "model process. A model whose forward is not shape-invariant (float32) runs without it (one log line); "
        "0: off",
    )
    prefix_cache_scope: Literal["tenant", "shared"] = Field(
        "tenant",
        description="which sessions may start from each other's cached prefixes: 'tenant' (the default) only "
        "sessions of the same tenant, on the target's every TP rank and on the draft replica, so no tenant can "
        "learn from a request's speed whether another tenant recently sent the same prompt prefix; 'shared' "
        "every session of the model (more hits, e.g. a system prompt common to all tenants; the timing side "
        "channel is open). Either way a request's cache_salt shares only with requests of the same salt",
    )
    draft_min_confidence: float = Field(
        0.0, ge=0.0, le=1.0,
        description="default early stop of drafting (requests may set their own): end a block after "
                    "a drafted token whose draft probability is below this; 0 = off",
    )
    tenants_file: str | None = Field(None, description="tenants YAML (issue 4); None: no auth")
    target_dtype: WeightFormat | None = Field(
        None, description="weight format of the target: float32, bfloat16, float16, int8, int4, w8a8 or w7a8 "
                          "(at target_tp > 1 each rank quantizes its own shard); None: the device's default "
                          "(specdec.models.formats.default_format)",
    )
    draft_dtype: WeightFormat | None = Field(
        None, description="weight format of the draft; None: the device's draft default "
                          "(specdec.models.formats.default_draft_format)",
    )
    draft_vocab_subset: int | None = Field(
        None, ge=1, description="the draft scores only this many most frequent token ids (FR-Spec; "
        "specdec.models.vocab_subset), its output layer sliced at load; the target scores all. None: all",
    )
    draft_vocab_table: str | None = Field(
        None, description="token frequency table of draft_vocab_subset (a file written by "
        "scripts/vocab_table.py); None: the one shipped for the demo pair's tokenizer",
    )
    cpu_threads: int = Field(
        0, ge=0, le=256,
        description="torch CPU threads per model process (draft, each TP rank); 0: the whole CPUs Ray "
                    "assigned to it (draft_num_cpus, target_cpus_per_worker), at least 1",
    )
    target_session_idle_timeout_s: float = Field(
        600, gt=0,
        description="a target session unused this long is freed (its KV cache shards on every TP rank); "
                    "its draft, if still alive, rebuilds it from the token history",
    )
    omp_spin_count: int = Field(
        OMP_SPIN_COUNT, ge=0, le=10_000_000, strict=True,
        description="libgomp spin count of the model processes' OpenMP threads (GOMP_SPINCOUNT, beside "
                    "OMP_WAIT_POLICY=PASSIVE): a thread waiting for work spins this many pauses before it "
                    "sleeps, so a forward's back-to-back parallel regions do not pay a futex wake-up each; "
                    "0 (default): sleep at once. Worth setting (e.g. 30000) where every model process has "
                    "cores of its own; where the draft replica and the TP ranks share cores, the spin "
                    "takes them from the process that computes (measured: README)",
    )
    draft_cpu_threads: int = Field(
        0, ge=0, le=256,
        description="torch CPU threads of the draft replica; 0: cpu_threads. For machines where the draft "
                    "may use cores that the target leaves idle while the draft drafts (local-cpu)",
    )
    max_chat_messages: int = Field(
        2048, ge=1, le=1_000_000,
        description="most messages one chat request (OpenAI chat completions, gRPC messages) may carry; more are "
                    "refused (400 / INVALID_ARGUMENT) before the chat template is applied: every message adds "
                    "template text that must be tokenized, so 50,000 empty messages cost seconds of router time",
    )
    ready_timeout_s: float = Field(
        2.0, gt=0, description="how long the router waits for the models before answering UNAVAILABLE",
    )
    router_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each router replica needs (pins it to the nodes that "
                    "advertise them, e.g. a Kubernetes worker group's rayStartParams.resources)",
    )
    draft_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each draft replica needs (see router_resources)",
    )
    target_resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources of each target replica's placement group (in its first bundle; "
                    "STRICT_PACK keeps the TP ranks on the same node)",
    )

    @field_validator("omp_spin_count", mode="before")
    @classmethod
    def _spin_count_is_an_integer(cls, value: Any) -> Any:
        """Refuse a string or a float as ``omp_spin_count`` with a message that says why: YAML 1.1
        (PyYAML) reads ``3e4`` as the string ``'3e4'`` (its floats need a dot: ``3.0e+4``, a float),
        and pydantic's strict "Input should be a valid integer" did not say so.

        Raises:
            ValueError: the value is a string or a float.
        """
        if isinstance(value, str):
            hint = ""
            if re.fullmatch(r"[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+", value.strip()):
                hint = f": YAML reads {value.strip()} as a string, not a number; write the digits"
            raise ValueError(f"Input should be an integer like 30000, got the string {value!r}{hint}")
        if isinstance(value, float):
            raise ValueError(f"Input should be an integer like 30000, got the float {value!r}")
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> "AppConfig":
        """Refuse one port for both proxies.

        Raises:
            ValueError: ``grpc_port == http_port``. Serve's gRPC and HTTP proxies both listen with
                SO_REUSEPORT, so both bound it and the kernel split the connections between them:
                the application reported ready while calls of either protocol reached the other proxy.
        """
        if self.grpc_port == self.http_port:
            raise ValueError(f"grpc_port and http_port are both {self.grpc_port}: the gRPC and HTTP proxies "
                             "need a port each")
        return self

    def target_format(self) -> str:
        """The target's weight format: ``target_dtype``, else the default of its device."""
        from specdec.models.formats import default_format

        device = "cuda" if self.target_gpus_per_worker > 0 else "cpu"
        return self.target_dtype or default_format(device)

    def draft_format(self, device: str = "cpu") -> str:
        """The draft's weight format: ``draft_dtype``, else the draft default of ``device``
        (:func:`specdec.models.formats.default_draft_format`: int4 on a VNNI CPU without AMX)."""
        from specdec.models.formats import default_draft_format

        return self.draft_dtype or default_draft_format(device)

    def model_pair(self) -> dict[str, Any]:
        """What identifies the draft/target pair, from this config's fields alone (no model
        loaded, no torch, no environment: a router replica calls it): the model specs, the weight
        formats as configured, the devices the config gives the models and the draft's vocabulary
        subset. The application's shared controller actor and its snapshot are named after it
        (:func:`deployments.controller_actor.actor_name`: another pair under the same application
        name gets its own), and its snapshot records it (:mod:`deployments.controller_actor`):
        acceptance and costs are the pair's.

        Router and draft replicas of one config compute the same value, whatever their processes'
        environment: a format not named (``target_dtype`` / ``draft_dtype`` None) is recorded as
        ``"default"``, not resolved: the default resolves per host when a replica loads its model
        (``$SPECDEC_WEIGHT_FORMAT``, else the device's default, which for a CPU draft depends on
        the CPU), and those can differ between the router's and a draft replica's processes or
        pods. So two deployments of one config whose defaults resolve differently share a pair.
        """
        return {
            "target_model": self.target_model,
            "target_format": self.target_dtype or "default",
            "target_device": "cuda" if self.target_gpus_per_worker > 0 else "cpu",
            "draft_model": self.draft_model,
            "draft_format": (self.draft_dtype or "default") if self.draft_model else None,
            "draft_device": ("cuda" if self.draft_num_gpus > 0 else "cpu") if self.draft_model else None,
            "draft_vocab_subset": self.draft_vocab_subset,
            "draft_vocab_table": self.draft_vocab_table,
        }

    def router_admission_slots(self) -> int:
        """Fair-admission slots of one router replica (``admission_slots``; default the draft
        replica's ``max_ongoing_requests``, at most the router's): requests beyond it wait in
        the router's per-tenant fair queue, not in Serve's first-come queue, so the router's
        ``max_ongoing_requests`` should exceed it (the local preset: 32 vs 8)."""
        if self.admission_slots is not None:
            return self.admission_slots
        return min(self.router.max_ongoing_requests, self.draft.max_ongoing_requests)

    def target_bundles(self) -> list[dict[str, float]]:
        """Placement group of one target replica: bundle 0 = replica, then one per TP rank."""
        worker: dict[str, float] = {"CPU": self.target_cpus_per_worker}
        if self.target_gpus_per_worker:
            worker["GPU"] = self.target_gpus_per_worker
        return [{"CPU": self.target_replica_cpus, **self.target_resources}] + [dict(worker) for _ in range(self.target_tp)]

    def deployment_options(self) -> dict[str, dict[str, Any]]:
        """Serve options per deployment name, shared by the config file and build_app."""
        sticky = {"request_router_class": CONSISTENT_HASH_ROUTER}
        draft_threads = torch_threads(self.draft_cpu_threads or self.cpu_threads, self.draft_num_cpus)
        draft_actor: dict[str, Any] = {"num_cpus": self.draft_num_cpus,
                                       "runtime_env": {"env_vars": model_process_env(draft_threads, self.omp_spin_count)}}
        if self.draft_num_gpus:
            draft_actor["num_gpus"] = self.draft_num_gpus
        if self.draft_resources:
            draft_actor["resources"] = dict(self.draft_resources)
        router_actor: dict[str, Any] = {"num_cpus": self.router_num_cpus}
        if self.router_resources:
            router_actor["resources"] = dict(self.router_resources)
        stop = {"graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S}
        return {
            "Router": {
                **self.router.serve_options(autoscale=True),
                **stop,
                "ray_actor_options": router_actor,
            },
            "Draft": {
                **self.draft.serve_options(autoscale=True),
                **stop,
                "ray_actor_options": draft_actor,
                "request_router_config": dict(sticky),
            },
            "Target": {
                **self.target.serve_options(autoscale=True),
                **stop,
                "ray_actor_options": {"num_cpus": self.target_replica_cpus},
                "placement_group_bundles": self.target_bundles(),
                "placement_group_strategy": "STRICT_PACK",
                "request_router_config": dict(sticky),
            },
        }


def to_serve_config(cfg: AppConfig) -> dict[str, Any]:
    """The Ray Serve config (``ServeDeploySchema`` shape) for ``cfg``."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": cfg.http_port, "request_timeout_s": cfg.request_timeout_s},
        "grpc_options": {
            "port": cfg.grpc_port,
            "grpc_servicer_functions": [SPECDEC_SERVICER, HEALTH_SERVICER],
            "request_timeout_s": cfg.request_timeout_s,
        },
        "applications": [
            {
                "name": cfg.app_name,
                "route_prefix": f"/{cfg.app_name}",
                "import_path": "deployments.app:build_app",
                "args": cfg.model_dump(mode="json"),
                "deployments": [
                    {"name": name, **opts} for name, opts in cfg.deployment_options().items() if name in BUILT
                ],
            }
        ],
    }


#: The configurations committed as YAML files (file name -> config).
PRESETS: dict[str, AppConfig] = {
    # 2 CPUs, no GPU: everything fractional, one replica each, the target in one process (TP=1)
    # with two torch threads. With the CPU default format (w8a8 on an AMX-INT8 or AVX512-VNNI +
    # bf16 CPU, int4 on another bf16-capable one) the demo pair serves in under 5 GB RSS (router,
    # draft, target replica and rank: 3.48 GiB in w8a8, README "On this machine: session 9's AMD
    # EPYC, served and batched"), and TP=1 measured faster and smaller than TP=2 over gloo (int4:
    # 5.4 vs 3.8 tok/s plain decoding, 4.5 vs 9.5 GB; docs/history/weight-formats.md, "Served with
    # the default"); --tp 2 still works (each rank quantizes its own shard).
    "local-cpu.yaml": AppConfig(
        target_tp=1,
        cpu_threads=2,
        # draft and target alternate within a step: the draft drafts on both cores while the
        # TP ranks wait (Ray assigns it 0.25 CPU, which would give one thread)
        draft_cpu_threads=2,
        # the router holds up to 32 requests; 8 (the draft's) run, the rest wait in its fair queue
        router=Scaling(min_replicas=1, max_replicas=1, max_ongoing_requests=32),
        # a fresh server's first request priced from measured forwards (deployments.draft_calibration)
        startup_calibration_repeats=3,
    ),
    # One GPU node: draft on a quarter GPU, target TP=2 on two GPUs (nccl), autoscaled router.
    "gpu.yaml": AppConfig(
        draft_num_gpus=0.25,
        draft_num_cpus=1,
        target_tp=2,
        target_gpus_per_worker=1,
        target_cpus_per_worker=2,
        target_replica_cpus=1,
        router_num_cpus=1,
        router=Scaling(min_replicas=1, max_replicas=4, target_ongoing_requests=8, max_ongoing_requests=32),
        draft=Scaling(min_replicas=1, max_replicas=2, max_ongoing_requests=16),
        target=Scaling(min_replicas=1, max_replicas=2, max_ongoing_requests=16),
        startup_calibration_repeats=3,
    ),
}


def torch_threads(cfg_threads: int, assigned_cpus: float | None) -> int:
    """Threads for torch in a model process.

    Args:
        cfg_threads: ``AppConfig.cpu_threads``; used when > 0.
        assigned_cpus: the CPUs Ray assigned to the process (:func:`ray_assigned_cpus`, or a
            placement-group bundle's ``CPU``); None or less than one: one thread.

    Returns:
        ``cfg_threads``, else the whole CPUs assigned (at least 1). Never the host's core count:
        inside a pod that is the node's, and every process would oversubscribe it.
    """
    if cfg_threads > 0:
        return int(cfg_threads)
    return max(1, int((assigned_cpus or 0) + 1e-9))


def model_process_env(threads: int = 0, spin_count: int = OMP_SPIN_COUNT) -> dict[str, str]:
    """Environment variables of a process that runs a model (a draft replica, a TP rank), for its
    Ray ``runtime_env``: Ray sets them when it starts the worker process, before torch loads
    libgomp, which reads them once.

    - ``OMP_WAIT_POLICY`` = :data:`OMP_WAIT_POLICY`: idle OpenMP threads sleep instead of
      spinning against the other model process's threads.
    - ``GOMP_SPINCOUNT`` = ``spin_count``: but first spin that many pauses (a bounded spin), so
      the parallel regions of one forward, microseconds apart, find their team awake. Set also
      when 0 (sleep at once): a GOMP_SPINCOUNT in the environment of whoever started Ray would
      otherwise reach the model processes and override PASSIVE's zero.
    - ``OMP_NUM_THREADS`` = ``threads`` when > 0: the OpenMP team size of *every* thread of the
      process. Ray otherwise sets 1 for a fractional-CPU actor, and ``torch.set_num_threads``
      changes only the calling thread's OpenMP setting: a thread that calls oneDNN (the w8a8
      linears) before any of torch's own parallel loops would run it on one thread.

    Args:
        threads: torch threads of the process (0: leave ``OMP_NUM_THREADS`` to Ray).
        spin_count: ``AppConfig.omp_spin_count`` (0: sleep at once).

    Raises:
        ValueError: ``threads`` or ``spin_count`` negative.
    """
    if threads < 0 or spin_count < 0:
        raise ValueError(f"threads and spin_count must be >= 0, got {threads}, {spin_count}")
    env = {"OMP_WAIT_POLICY": OMP_WAIT_POLICY, "GOMP_SPINCOUNT": str(int(spin_count))}
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(int(threads))
    return env


def ray_assigned_cpus() -> float | None:
    """CPUs Ray assigned to this worker process (None outside Ray or when none were)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:
        return None


def freeze_startup_objects_in_actor() -> int | None:
    """At the end of a replica's or TP rank's start-up: :func:`specdec.engine.gc_freeze.freeze_startup_objects`
    when this process is a Ray actor (a long-lived serving process; not a test process that builds
    replicas in process, which would pay a full collection each time and keep its dead objects).
    Returns the objects frozen, or None outside an actor."""
    try:
        import ray

        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return None
    except Exception:
        return None
    from specdec.engine.gc_freeze import freeze_startup_objects

    return freeze_startup_objects()
