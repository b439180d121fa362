"""user12's served probe: one locked run. Env: KA, KB (tenant keys), SERVE_PID, METRICS_PORT."""
import json, os, signal, subprocess, sys, threading, time, urllib.request
sys.path.append("/tmp/u12/pylib")  # unused where the venv has openai (the dev extra)
import openai
from deployments.client import SpecDecClient

KA, KB = os.environ["KA"], os.environ["KB"]
BASE = "http://localhost:8000/specdec/v1"
T0 = time.time()
def log(*a):
    print(f"[{time.time()-T0:6.1f}s load {open('/proc/loadavg').read().split()[0]}]", *a, flush=True)
def step(name, fn):
    t = time.time()
    try:
        r = fn()
        log(f"{name}: OK in {time.time()-t:.2f}s:", r)
    except Exception as e:
        log(f"{name}: {type(e).__name__} in {time.time()-t:.2f}s: {str(e)[:400]}")
def rss():
    out = subprocess.run("ps -eo rss,args | grep -E 'ray::(ServeReplica|TPWorker)' | grep -v grep", shell=True,
                         capture_output=True, text=True).stdout
    return round(sum(int(l.split()[0]) for l in out.splitlines()) / 2**20, 2)

A = openai.OpenAI(base_url=BASE, api_key=KA, max_retries=0, timeout=120)
B = openai.OpenAI(base_url=BASE, api_key=KB, max_retries=0, timeout=120)
ga, gb = SpecDecClient("localhost:9000", api_key=KA), SpecDecClient("localhost:9000", api_key=KB)
P = ["def fibonacci(n):", "def is_palindrome(s: str) -> bool:", "SELECT name FROM users WHERE", "class Stack:"]
what = sys.argv[1]

if what == "api":
    log("RSS GiB at ready", rss())
    step("chat greedy 32", lambda: (lambda r: (r.choices[0].message.content[:80], r.usage.completion_tokens, r.speculation_stats.get("acceptance_rate") if hasattr(r, "speculation_stats") else None))(
        A.chat.completions.create(model="specdec", temperature=0, max_tokens=32, messages=[{"role": "user", "content": "Write a Python prime check."}])))
    step("completions n=2 seed temp logprobs stop", lambda: [(c.text, c.finish_reason, c.logprobs.top_logprobs[:1] if c.logprobs else None) for c in
        A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=24, n=2, temperature=0.8, seed=7, logprobs=2, stop=["\n\n"]).choices])
    step("same seeded again (must equal)", lambda: [c.text for c in
        A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=24, n=2, temperature=0.8, seed=7, logprobs=2, stop=["\n\n"]).choices])
    step("chat logprobs top 2 stream", lambda: "".join(ch.choices[0].delta.content or "" for ch in A.chat.completions.create(
        model="specdec", temperature=0, max_tokens=16, logprobs=True, top_logprobs=2, stream=True,
        messages=[{"role": "user", "content": "Say hi"}]) if ch.choices))
    step("max_tokens 1e9", lambda: A.completions.create(model="specdec", prompt="x", max_tokens=10**9))
    step("unknown model", lambda: A.completions.create(model="gpt-4", prompt="x", max_tokens=4).choices[0].text)
    step("tenant-b max_completion_tokens over its limit", lambda: B.chat.completions.create(model="specdec", max_completion_tokens=2000, messages=[{"role": "user", "content": "hi"}]))
    # baselines alone (greedy), then concurrent mixed tenants with stream cancels
    alone = {}
    for i, p in enumerate(P):
        c = A if i % 2 == 0 else B
        alone[p] = c.completions.create(model="specdec", prompt=p, max_tokens=24, temperature=0).choices[0].text
    log("alone", alone)
    res = {}
    def full(i, p):
        c = A if i % 2 == 0 else B
        s = c.completions.create(model="specdec", prompt=p, max_tokens=24, temperature=0, stream=True)
        res[(i, p)] = "".join(ch.choices[0].text for ch in s if ch.choices)
    def cancel(i, p, after):
        c = B if i % 2 == 0 else A
        s = c.completions.create(model="specdec", prompt=p, max_tokens=200, temperature=0, stream=True)
        n = 0
        for ch in s:
            n += 1
            if n >= after:
                s.close(); break
        res[("cancel", i, p)] = n
    def gcancel(p):
        it = gb.stream(p, max_tokens=200)
        for n, ch in enumerate(it):
            if n >= 2:
                it.close(); break
        res[("gcancel", p)] = "closed"
    ths = [threading.Thread(target=full, args=(i, p)) for i, p in enumerate(P)]
    ths += [threading.Thread(target=cancel, args=(i, p, 2 + i)) for i, p in enumerate(P)]
    ths += [threading.Thread(target=gcancel, args=(p,)) for p in P[:2]]
    t = time.time()
    for th in ths: th.start()
    for th in ths: th.join(180)
    log(f"concurrent 10 requests in {time.time()-t:.1f}s;", "full outputs equal alone:",
        {p: res.get((i, p)) == alone[p] for i, p in enumerate(P)}, "cancels:", {k: v for k, v in res.items() if k[0] != 0 and isinstance(k[0], str)})
    step("after cancels: short request", lambda: ga.generate("def add(a, b):", max_tokens=8).text)
    step("tenant stats A", lambda: str(ga.tenant_stats()).replace("\n", " ")[:600])
    step("tenant stats B", lambda: str(gb.tenant_stats()).replace("\n", " ")[:600])
    def metrics():
        txt = urllib.request.urlopen(f"http://localhost:{os.environ['METRICS_PORT']}/metrics", timeout=10).read().decode()
        lines = [l for l in txt.splitlines() if l.startswith("ray_specdec_")]
        return len(lines), sorted({l.split("{")[0] for l in lines})[:40]
    step("metrics", metrics)
    log("RSS GiB", rss())

if what == "conc":
    alone = {}
    for i, p in enumerate(P):
        c = A if i % 2 == 0 else B
        alone[p] = c.completions.create(model="specdec", prompt=p, max_tokens=12, temperature=0).choices[0].text
    log("alone", alone)
    res = {}
    def full(i, p):
        c = A if i % 2 == 0 else B
        s = c.completions.create(model="specdec", prompt=p, max_tokens=12, temperature=0, stream=True)
        res[(i, p)] = "".join(ch.choices[0].text for ch in s if ch.choices)
    def cancel(i, p, after):
        c = B if i % 2 == 0 else A
        s = c.completions.create(model="specdec", prompt=p, max_tokens=200, temperature=0, stream=True)
        n = 0
        for ch in s:
            n += 1
            if n >= after:
                s.close(); break
        res[("cancel", i, p)] = n
    def gcancel(p):
        it = gb.stream(p, max_tokens=200)
        n = 0
        for n, ch in enumerate(it):
            if n >= 2:
                it.close(); break
        res[("gcancel", p)] = n
    ths = [threading.Thread(target=full, args=(i, p)) for i, p in enumerate(P)]
    ths += [threading.Thread(target=cancel, args=(i, p, 2 + i)) for i, p in enumerate(P)]
    ths += [threading.Thread(target=gcancel, args=(p,)) for p in P[:2]]
    t = time.time()
    for th in ths: th.start()
    for th in ths: th.join(120)
    log(f"concurrent 10 requests in {time.time()-t:.1f}s;", "full outputs equal alone:",
        {p: res.get((i, p)) == alone[p] for i, p in enumerate(P)}, "cancels:", {str(k): v for k, v in res.items() if isinstance(k[0], str)})
    step("after cancels: short request", lambda: ga.generate("def add(a, b):", max_tokens=8, timeout=60).text)
    step("tenant stats B", lambda: str(gb.tenant_stats()).replace("\n", " ")[:500])
    def metrics():
        txt = urllib.request.urlopen(f"http://localhost:{os.environ['METRICS_PORT']}/metrics", timeout=10).read().decode()
        lines = [l for l in txt.splitlines() if l.startswith("ray_specdec_")]
        return len(lines), sorted({l.split("{")[0] for l in lines})[:12]
    step("metrics", metrics)
    log("RSS GiB", rss())

if what == "deadline":
    # deadline shorter than the work: 504 / DEADLINE_EXCEEDED, then is the server free at once?
    step("short request baseline", lambda: ga.generate("def add(a, b):", max_tokens=8, timeout=90).text)
    step("http 256 tokens, specdec-timeout-s 3", lambda: A.completions.create(model="specdec", prompt="def quicksort(xs):", max_tokens=256, temperature=0,
         extra_headers={"specdec-timeout-s": "3"}).usage)
    step("next short request right after (server still busy?)", lambda: ga.generate("def add(a, b):", max_tokens=8, timeout=90).text)
    step("grpc 256 tokens, client timeout 3", lambda: ga.generate("def quicksort(xs):", max_tokens=256, timeout=3).text[:40])
    step("next short request right after", lambda: ga.generate("def add(a, b):", max_tokens=8, timeout=90).text)
    # long prompts: near/over the context; what do time and memory do
    word = " the"
    for n, to in ((2000, 45), (8000, 15)):
        p = "Summarize:" + word * n
        log("RSS GiB before", n, rss())
        step(f"prompt ~{n} tokens, 8 new, timeout {to}s", lambda: (lambda r: (r.usage.prompt_tokens, r.usage.completion_tokens))(
            A.completions.create(model="specdec", prompt=p, max_tokens=8, temperature=0, extra_headers={"specdec-timeout-s": str(to)})))
        log("RSS GiB after", n, rss())
        step("next short request right after", lambda: ga.generate("def add(a, b):", max_tokens=8, timeout=90).text)
    step("prompt over the context (~40000 tokens)", lambda: A.completions.create(model="specdec", prompt="Summarize:" + word * 40000, max_tokens=8))
    log("RSS GiB end", rss())

if what == "shutdown":
    out = {}
    def streamer():
        t = time.time(); n = 0
        try:
            for ch in ga.stream("def quicksort(xs):", max_tokens=400, timeout=60):
                n += 1
            out["g"] = f"finished after {n} chunks"
        except Exception as e:
            out["g"] = f"{type(e).__name__} after {n} chunks, {time.time()-t:.1f}s: {str(e)[:200]}"
    def hstreamer():
        t = time.time(); n = 0
        try:
            for ch in B.completions.create(model="specdec", prompt="class Stack:", max_tokens=400, stream=True, timeout=60):
                n += 1
            out["h"] = f"finished after {n} chunks"
        except Exception as e:
            out["h"] = f"{type(e).__name__} after {n} chunks, {time.time()-t:.1f}s: {str(e)[:200]}"
    ths = [threading.Thread(target=streamer), threading.Thread(target=hstreamer)]
    for th in ths: th.start()
    time.sleep(8)
    pid = int(os.environ["SERVE_PID"])
    log("SIGINT to specdec serve", pid)
    os.kill(pid, signal.SIGINT)
    for th in ths: th.join(90)
    log("clients saw:", out)
    t = time.time()
    while time.time() - t < 60:
        try:
            os.kill(pid, 0); time.sleep(0.5)
        except ProcessLookupError:
            break
    log(f"serve exited after {time.time()-t:.1f}s more" if time.time() - t < 60 else "serve still running after 60s")
    step("new client after shutdown", lambda: SpecDecClient("localhost:9000", api_key=KA).generate("x", max_tokens=2, timeout=5).text)
