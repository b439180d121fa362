"""How long `specdec serve --keep-running` takes to exit after SIGINT (session 14, harden).

Starts it on the tiny pair in /tmp/harden/{target,draft} (specdec.testing.tiny.build_tiny_model,
seeds 0 and 1 as tests/deployments/test_openai_api.py builds them), ports 19000/18000, in its own
session; once "serving; Ctrl-C to stop" is printed sends SIGINT (``--group``: to the whole
process group, as a terminal's Ctrl-C) and prints the seconds to exit, what is left of the process
group, and with ``--inflight`` what an HTTP stream and a gRPC stream (4000 tokens, started 2 s
before) got. ``--grace S`` passes ``--shutdown-grace S``. Run from the repository root, in a
network namespace:

    ip netns exec ns-harden .venv/bin/python docs/bench/harden-s14/measure_stop.py --inflight
"""
import os, signal, subprocess, sys, time, threading, json

inflight = "--inflight" in sys.argv
env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_TMPDIR": "/tmp/ray-harden",
       "PYTHONPATH": os.getcwd(), "PYTHONUNBUFFERED": "1"}
cmd = [sys.executable, "-c", "import sys; from specdec.cli import main; sys.exit(main())", "serve",
       "--target", "/tmp/harden/target", "--draft", "/tmp/harden/draft", "--num-cpus", "2", "--keep-running",
       "--grpc-port", "19000", "--http-port", "18000"]
if "--grace" in sys.argv:
    cmd += ["--shutdown-grace", sys.argv[sys.argv.index("--grace") + 1]]
t0 = time.monotonic()
p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
ready = threading.Event()
lines = []
def reader():
    for line in p.stderr:
        lines.append((time.monotonic() - t0, line.rstrip()))
        print(f"{time.monotonic() - t0:7.2f} {line.rstrip()}", flush=True)
        if "serving; Ctrl-C to stop" in line:
            ready.set()
threading.Thread(target=reader, daemon=True).start()
if not ready.wait(240):
    p.kill(); sys.exit("not ready")
result = {}
def request():
    import httpx2 as httpx
    t = time.monotonic()
    try:
        r = httpx.post("http://localhost:18000/specdec/v1/completions", timeout=120,
                       json={"model": "specdec", "prompt": "def add(a, b):", "max_tokens": 4000, "temperature": 0,
                             "ignore_eos": True, "stream": True})
        result["status"] = r.status_code; result["tail"] = r.text[-300:]
    except Exception as e:
        result["error"] = repr(e)
    result["s"] = time.monotonic() - t
gres = {}
def grpc_request():
    from deployments.client import SpecDecClient, SpecDecError
    t = time.monotonic(); n = 0
    try:
        with SpecDecClient("localhost:19000") as c:
            for piece in c.stream(prompt="def add(a, b):", max_tokens=4000, ignore_eos=True, temperature=0.0):
                n += 1
        gres["ok"] = n
    except SpecDecError as e:
        gres["error"] = f"{e.code}: {e.details}"; gres["chunks"] = n
    except Exception as e:
        gres["other"] = repr(e)[:300]; gres["chunks"] = n
    gres["s"] = time.monotonic() - t
th = None
if inflight:
    th = threading.Thread(target=request); th.start()
    th2 = threading.Thread(target=grpc_request); th2.start(); time.sleep(2)
ts = time.monotonic()
print(f"{ts - t0:7.2f} >>> SIGINT", flush=True)
if "--group" in sys.argv:  # a terminal's Ctrl-C: the whole foreground process group
    os.killpg(p.pid, signal.SIGINT)
else:
    p.send_signal(signal.SIGINT)
rc = p.wait(180)
te = time.monotonic()
print(f"exit rc={rc} after {te - ts:.1f} s", flush=True)
left = subprocess.run(["pgrep", "-g", str(p.pid), "-a"], capture_output=True, text=True).stdout
print("left in the group:", left.strip() or "none", flush=True)
if th:
    th.join(150); print("http request:", json.dumps(result)[:600])
    th2.join(150); print("grpc request:", json.dumps(gres)[:600])
    import httpx2
    try:
        r = httpx2.post("http://localhost:18000/specdec/v1/completions", timeout=5, json={"model": "specdec", "prompt": "x"})
        print("after exit:", r.status_code)
    except Exception as e:
        print("after exit:", type(e).__name__)
