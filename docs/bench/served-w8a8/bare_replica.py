"""What a Serve replica holds before any of our code: ``python bare_replica.py`` (in a network
namespace, own RAY_TMPDIR). Serves one trivial deployment and prints its replica's RSS/RssAnon/PSS
(MiB) and module count, then the same after importing, inside that replica, each of the modules
named on the command line (cumulative), e.g. ``torch transformers``."""
import os
import sys
import time

import ray
from ray import serve


def _mem() -> dict:
    st = {l.split(":")[0]: int(l.split()[1]) // 1024 for l in open("/proc/self/status")
          if l.startswith(("VmRSS", "RssAnon", "RssFile"))}
    st["Pss"] = next(int(l.split()[1]) // 1024 for l in open("/proc/self/smaps_rollup") if l.startswith("Pss:"))
    st["modules"] = len(sys.modules)
    st["torch"] = "torch" in sys.modules
    return st


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Bare:
    def probe(self, module: str | None = None) -> dict:
        if module:
            __import__(module)
        return _mem()


if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False)
    h = serve.run(Bare.bind(), name="bare", route_prefix=None)
    time.sleep(3)
    print("bare replica:", h.probe.remote().result())
    for m in sys.argv[1:]:
        print(f"+ import {m}:", h.probe.remote(m).result())
    serve.shutdown()
    ray.shutdown()
