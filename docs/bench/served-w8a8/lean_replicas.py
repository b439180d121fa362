"""RSS of a router and a target replica as the served w8a8 pair builds them, without the models:
``python lean_replicas.py`` in a network namespace (own RAY_TMPDIR), PYTHONPATH = the tree to
measure. One Serve app of two deployments: RouterProbe builds ``deployments.router.Router`` for
the demo target in w8a8 (its TargetInfo as the replica reads it, the demo tokenizer; a local
tenancy gate) and admits one request; TargetProbe does what ``Target._start_workers`` does before
starting the ranks (imports the TP worker module, finds the target folder). Prints each replica's
RSS / RssAnon / PSS (MiB) and whether it imported torch."""
import asyncio
import sys
import time

import ray
from ray import serve


def _mem() -> dict:
    st = {l.split(":")[0]: int(l.split()[1]) // 1024 for l in open("/proc/self/status")
          if l.startswith(("VmRSS", "RssAnon", "RssFile"))}
    st["Pss"] = next(int(l.split()[1]) // 1024 for l in open("/proc/self/smaps_rollup") if l.startswith("Pss:"))
    st["torch"] = "torch" in sys.modules
    import deployments

    st["tree"] = deployments.__file__
    return st


def _cfg():
    from deployments.config import AppConfig

    return AppConfig(target_model="demo:target", draft_model="demo:draft", target_dtype="w8a8", draft_dtype="w8a8")


@serve.deployment(ray_actor_options={"num_cpus": 0})
class RouterProbe:
    def __init__(self):
        from deployments.controller_client import ControllerClient
        from deployments.metrics import SpecDecMetrics
        from deployments.router import Router
        from deployments.tenancy import TenancyGate

        cfg = _cfg()
        self.r = Router(cfg, gate=TenancyGate(None, ControllerClient.local(), SpecDecMetrics(backend=None)))
        self.r.__serve_build_asgi_app__()

    async def probe(self) -> dict:
        await self.r._prepare({"prompt": "def add(a, b):", "max_tokens": 4}, {})
        return _mem()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class TargetProbe:
    def __init__(self):
        from deployments.tp_worker import start_tp_workers  # noqa: F401 (as Target._start_workers)

        cfg = _cfg()
        try:
            from deployments.target_info import target_folder

            self.folder = target_folder(cfg)
        except ImportError:  # the code before: resolve_folder
            from specdec.models.loader import resolve_folder

            self.folder = resolve_folder(cfg.target_model, cfg.target_format())
        from deployments.target import Target

        self.t = Target(cfg, workers=[])

    def probe(self) -> dict:
        return {**_mem(), "folder": str(self.folder)}


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False)
    serve.start()
    rh = serve.run(RouterProbe.bind(), name="r", route_prefix=None)
    th = serve.run(TargetProbe.bind(), name="t", route_prefix=None)
    time.sleep(2)
    print(f"tree {sys.path[1] if len(sys.path) > 1 else ''}")
    print("router replica:", rh.probe.remote().result())
    print("target replica:", th.probe.remote().result())
    serve.shutdown()
    ray.shutdown()
