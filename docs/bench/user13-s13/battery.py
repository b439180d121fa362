"""A new user's checks against a running `specdec serve --tenants tenants.yaml` (gRPC :9000, HTTP :8000)."""
import os, json, sys, time, threading, socket, traceback, http.client, urllib.request, concurrent.futures as cf
KA = os.environ["KEY_A"]  # team-a (keys made with new-key for this run, thrown away)
KB = os.environ["KEY_B"]  # team-b
BASE = "http://localhost:8000/specdec/v1"
T0 = time.time()
only = set(sys.argv[1:])

def log(*a):
    print(f"[{time.time()-T0:6.1f}s]", *a, flush=True)

def check(name):
    def deco(f):
        if only and name not in only:
            return f
        try:
            log("==", name)
            f()
        except Exception as e:
            log("!! EXC in", name, type(e).__name__, str(e)[:600])
        return f
    return deco

def raw(method, path, body=None, headers=None, key=KA):
    c = http.client.HTTPConnection("localhost", 8000, timeout=120)
    h = {"Content-Type": "application/json"}
    if key: h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    if isinstance(body, (dict, list)): body = json.dumps(body)
    if isinstance(body, str): body = body.encode()
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    return r.status, dict(r.getheaders()), data.decode("utf-8", "replace")

def show(label, st, hd, data):
    log(f"{label}: {st} retry-after={hd.get('retry-after')} {data[:400]}")

from openai import OpenAI
import openai
A = OpenAI(base_url=BASE, api_key=KA, max_retries=0, timeout=120)
B = OpenAI(base_url=BASE, api_key=KB, max_retries=0, timeout=120)
from deployments.client import SpecDecClient
GA = SpecDecClient("localhost:9000", api_key=KA)
GB = SpecDecClient("localhost:9000", api_key=KB)

@check("basic")
def _():
    show("GET /specdec/", *raw("GET", "/specdec/"))
    show("health", *raw("GET", "/specdec/health"))
    log("models", [m.id for m in A.models.list().data])
    r = A.chat.completions.create(model="specdec", temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "Write a prime check in Python."}],
        extra_body={"speculation": {"proposer": "draft", "max_k": 4}})
    log("chat", repr(r.choices[0].message.content), r.speculation_stats["acceptance_rate"], r.usage, r.choices[0].finish_reason)
    parts = []
    for chunk in A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=16, stream=True, temperature=0,
                                      stream_options={"include_usage": True}):
        parts.append(chunk.choices[0].text if chunk.choices else f"<usage {chunk.usage}>")
    log("stream", parts)
    u = A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=16, temperature=0)
    log("unary", repr(u.choices[0].text), "stream==unary", "".join(p for p in parts if not p.startswith("<usage")) == u.choices[0].text)
    g = GA.generate("def add(a, b):", max_tokens=16)
    log("grpc", repr(g.text), list(g.token_ids) if hasattr(g, "token_ids") else None, "grpc==http", g.text == u.choices[0].text,
        "http ids", u.choices[0].token_ids if hasattr(u.choices[0], "token_ids") else getattr(u.choices[0], "model_extra", {}).get("token_ids"))
    s = "".join(c.text for c in GA.stream("def add(a, b):", max_tokens=16))
    log("grpc stream == unary", s == g.text)

@check("bad_http")
def _():
    P = "/specdec/v1/completions"
    C = "/specdec/v1/chat/completions"
    cases = [
        ("empty prompt", P, {"model": "specdec", "prompt": "", "max_tokens": 4}),
        ("empty messages", C, {"model": "specdec", "messages": [], "max_tokens": 4}),
        ("huge max_tokens", P, {"model": "specdec", "prompt": "hi", "max_tokens": 10**12}),
        ("max_tokens over tenant", P, {"model": "specdec", "prompt": "hi", "max_tokens": 65}),
        ("max_tokens 0", P, {"model": "specdec", "prompt": "hi", "max_tokens": 0}),
        ("max_tokens -1", P, {"model": "specdec", "prompt": "hi", "max_tokens": -1}),
        ("wrong model", P, {"model": "gpt-4", "prompt": "hi", "max_tokens": 4}),
        ("no model", P, {"prompt": "hi", "max_tokens": 4}),
        ("neg temperature", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "temperature": -0.5}),
        ("temperature 3", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "temperature": 3}),
        ("top_p 0", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "top_p": 0}),
        ("top_p 1.5", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "top_p": 1.5}),
        ("n 0", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "n": 0}),
        ("n 100", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "n": 100}),
        ("seed -1", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "seed": -1, "temperature": 1}),
        ("seed 2**64", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "seed": 2**64, "temperature": 1}),
        ("prompt over tenant limit", P, {"model": "specdec", "prompt": "word " * 200, "max_tokens": 4}),
        ("prompt token ids bad", P, {"model": "specdec", "prompt": [10**9], "max_tokens": 4}),
        ("prompt ids negative", P, {"model": "specdec", "prompt": [-1], "max_tokens": 4}),
        ("prompt list of strings", P, {"model": "specdec", "prompt": ["a", "b"], "max_tokens": 4}),
        ("prompt null", P, {"model": "specdec", "prompt": None, "max_tokens": 4}),
        ("max_tokens string", P, {"model": "specdec", "prompt": "hi", "max_tokens": "5"}),
        ("max_tokens float", P, {"model": "specdec", "prompt": "hi", "max_tokens": 5.0}),
        ("unknown field", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "best_of": 3}),
        ("echo", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "echo": True}),
        ("suffix", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "suffix": "x"}),
        ("logit_bias bad id", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logit_bias": {"abc": 1}}),
        ("logit_bias huge id", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logit_bias": {"99999999": 1}}),
        ("logit_bias 1000", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logit_bias": {"13": 1000}}),
        ("logprobs 30", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logprobs": 30}),
        ("stop 5 strings", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "stop": ["a", "b", "c", "d", "e"]}),
        ("stop empty string", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "stop": [""]}),
        ("role bad", C, {"model": "specdec", "messages": [{"role": "robot", "content": "hi"}], "max_tokens": 4}),
        ("content list", C, {"model": "specdec", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 4}),
        ("content null", C, {"model": "specdec", "messages": [{"role": "user", "content": None}], "max_tokens": 4}),
        ("tools", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": []}),
        ("response_format", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {"type": "json_object"}}),
        ("max_k 99", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "speculation": {"max_k": 99}}),
        ("proposer bogus", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "speculation": {"proposer": "eagle"}}),
        ("body is list", P, [1, 2]),
        ("body is string", P, '"hello"'),
    ]
    for label, path, body in cases:
        show(label, *raw("POST", path, body))
    show("malformed JSON", *raw("POST", P, '{"model": "specdec", "prompt": "hi",'))
    show("empty body", *raw("POST", P, b""))
    show("invalid UTF-8 body", *raw("POST", P, b'{"model": "specdec", "prompt": "hi \xff\xfe", "max_tokens": 4}'))
    show("lone surrogate escape", *raw("POST", P, '{"model": "specdec", "prompt": "hi \\ud800", "max_tokens": 4}'))
    show("NaN temperature", *raw("POST", P, '{"model": "specdec", "prompt": "hi", "max_tokens": 4, "temperature": NaN}'))
    show("Infinity top_p", *raw("POST", P, '{"model": "specdec", "prompt": "hi", "max_tokens": 4, "top_p": Infinity}'))
    show("text/plain content-type", *raw("POST", P, {"model": "specdec", "prompt": "hi", "max_tokens": 2}, headers={"Content-Type": "text/plain"}))
    show("no key", *raw("POST", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4}, key=None))
    show("unknown key", *raw("POST", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4}, key="sk-nope"))
    show("Basic auth", *raw("POST", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4}, key=None, headers={"Authorization": "Basic abc"}))
    show("GET completions", *raw("GET", P))
    show("unknown path", *raw("GET", "/specdec/v1/embeddings"))
    show("POST embeddings", *raw("POST", "/specdec/v1/embeddings", {"model": "specdec", "input": "hi"}))
    show("models/specdec", *raw("GET", "/specdec/v1/models/specdec"))
    show("session id long", *raw("POST", P, {"model": "specdec", "prompt": "hi", "max_tokens": 2}, headers={"x-session-id": "x" * 300}))
    show("timeout header bad", *raw("POST", P, {"model": "specdec", "prompt": "hi", "max_tokens": 2}, headers={"specdec-timeout-s": "abc"}))
    show("timeout header neg", *raw("POST", P, {"model": "specdec", "prompt": "hi", "max_tokens": 2}, headers={"specdec-timeout-s": "-1"}))
    show("timeout tiny", *raw("POST", P, {"model": "specdec", "prompt": "hi", "max_tokens": 60, "temperature": 0}, headers={"specdec-timeout-s": "0.5"}))
    show("stream + bad", *raw("POST", P, {"model": "specdec", "prompt": "", "max_tokens": 4, "stream": True}))
    show("huge body", *raw("POST", P, b'{"model": "specdec", "prompt": "' + b"a" * (40 * 1024 * 1024) + b'"}'))
    try:
        A.completions.create(model="nope", prompt="hi", max_tokens=2)
    except openai.APIStatusError as e:
        log("openai wrong model ->", type(e).__name__, e.status_code, e.body)

@check("bad_grpc")
def _():
    import grpc
    from deployments import client as cm
    tries = [
        ("empty prompt", dict(prompt="", max_tokens=4)),
        ("huge max_tokens", dict(prompt="hi", max_tokens=10**9)),
        ("max_tokens over tenant", dict(prompt="hi", max_tokens=65)),
        ("neg temperature", dict(prompt="hi", max_tokens=4, temperature=-1.0)),
        ("prompt over limit", dict(prompt="word " * 200, max_tokens=4)),
        ("max_k 99", dict(prompt="hi", max_tokens=4, max_k=99)),
    ]
    for label, kw in tries:
        try:
            r = GA.generate(**kw)
            log(label, "-> OK?!", repr(r.text))
        except Exception as e:
            log(label, "->", type(e).__name__, str(e)[:300])
    for label, key in (("unknown key", "sk-bad"), ("no key", None)):
        try:
            SpecDecClient("localhost:9000", api_key=key).generate("hi", max_tokens=2); log(label, "OK?!")
        except Exception as e:
            log(label, "->", type(e).__name__, str(e)[:200])
    try:
        SpecDecClient("localhost:9000", application="other", api_key=KA).generate("hi", max_tokens=2); log("other app OK?!")
    except Exception as e:
        log("other app ->", type(e).__name__, str(e)[:200])
    ch = grpc.insecure_channel("localhost:9000")
    call = ch.unary_unary("/specdec.v1.SpecDec/Generate", request_serializer=None, response_deserializer=None)
    # field 1 (prompt? check) as length-delimited invalid UTF-8
    for label, payload in (("garbage bytes", b"\xff\xff\xff\x07"), ("invalid utf8 string field 1", b"\x0a\x02\xff\xfe")):
        try:
            call(payload, metadata=[("application", "specdec"), ("authorization", f"Bearer {KA}")], timeout=30); log(label, "OK?!")
        except grpc.RpcError as e:
            log(label, "->", e.code(), e.details()[:200])
    # deadline
    try:
        GA.generate("def f():", max_tokens=60, timeout=0.5); log("timeout OK?!")
    except Exception as e:
        log("timeout 0.5 ->", type(e).__name__, str(e)[:200])
    # cancel mid-stream
    it = GA.stream("def quicksort(xs):", max_tokens=60)
    first = next(iter(it))
    log("got first chunk", repr(first.text)); it.close() if hasattr(it, "close") else None
    del it
    time.sleep(1)
    log("tenant stats A", str(GA.tenant_stats())[:1500])

@check("cancel_http")
def _():
    st = A.completions.create(model="specdec", prompt="def quicksort(xs):", max_tokens=60, stream=True, temperature=0)
    for i, ch in enumerate(st):
        if i == 1: break
    st.close()
    time.sleep(2)
    r = A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=4, temperature=0)
    log("after cancel ok", repr(r.choices[0].text))
    # raw socket cut mid-stream
    s = socket.create_connection(("localhost", 8000))
    body = json.dumps({"model": "specdec", "prompt": "def quicksort(xs):", "max_tokens": 60, "temperature": 0, "stream": True}).encode()
    s.sendall(b"POST /specdec/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer " + KA.encode() +
              b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    log("raw first bytes", s.recv(300)[:200]); s.close()
    time.sleep(2)

@check("concurrent")
def _():
    def job(i):
        kind = i % 5
        try:
            if kind == 0:
                return i, "grpcA", GA.generate("def add(a, b):", max_tokens=8).text
            if kind == 1:
                return i, "httpA", A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=8, temperature=0).choices[0].text
            if kind == 2:
                return i, "httpB-stream", "".join(c.choices[0].text for c in B.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=8, temperature=0, stream=True) if c.choices)
            if kind == 3:
                return i, "chatB-sampled", B.chat.completions.create(model="specdec", max_tokens=8, temperature=0.8, seed=i, messages=[{"role": "user", "content": "hi"}]).choices[0].message.content
            return i, "grpcB-stream", "".join(c.text for c in GB.stream("def add(a, b):", max_tokens=8))
        except Exception as e:
            return i, "ERR", f"{type(e).__name__}: {str(e)[:200]}"
    t = time.time()
    with cf.ThreadPoolExecutor(20) as ex:
        res = sorted(ex.map(job, range(20)))
    log(f"20 concurrent in {time.time()-t:.1f}s")
    for r in res: log("  ", r)
    greedy = {r[2] for r in res if r[1] in ("grpcA", "httpA", "httpB-stream", "grpcB-stream")}
    log("distinct greedy outputs", greedy)
    show("health after", *raw("GET", "/specdec/health"))

@check("stats")
def _():
    for who, g in (("A", GA), ("B", GB)):
        log("tenant stats", who, str(g.tenant_stats()).replace("\n", " ")[:1500])
    import re
    try:
        m = urllib.request.urlopen("http://localhost:9100/metrics", timeout=30).read().decode()
        lines = [l for l in m.splitlines() if l.startswith("ray_specdec_") ]
        log("metrics lines", len(lines))
        for l in lines[:60]: log("   ", l[:200])
    except Exception as e:
        log("metrics ERR", e)
    # tokens per minute / concurrency limit
    def j(i):
        try:
            return A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=4, temperature=0).choices[0].text
        except openai.APIStatusError as e:
            return f"{e.status_code} {e.response.headers.get('retry-after')} {e.body}"
    with cf.ThreadPoolExecutor(6) as ex:
        for r in ex.map(j, range(6)): log("burst A:", str(r)[:300])
    show("final health", *raw("GET", "/specdec/health"))

@check("features")
def _():
    r = A.completions.create(model="specdec", prompt="Once upon a time", max_tokens=8, n=2, seed=5, temperature=0.9)
    log("n=2 seeded", [c.text for c in r.choices], r.usage)
    r2 = A.completions.create(model="specdec", prompt="Once upon a time", max_tokens=8, n=2, seed=5, temperature=0.9)
    log("seed reproducible", [c.text for c in r.choices] == [c.text for c in r2.choices])
    r = A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=2)
    log("completions logprobs", r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs, r.choices[0].logprobs.top_logprobs)
    r = A.chat.completions.create(model="specdec", temperature=0, max_tokens=5, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "Say hi"}])
    log("chat logprobs", [(t.token, round(t.logprob, 3), [a.token for a in t.top_logprobs]) for t in r.choices[0].logprobs.content])
    r = A.completions.create(model="specdec", prompt="def add(a, b):", max_tokens=30, temperature=0, stop=["\n"])
    log("stop newline", repr(r.choices[0].text), r.choices[0].finish_reason, getattr(r.choices[0], "finish_detail", None))
    st = A.chat.completions.create(model="specdec", temperature=0, max_tokens=8, stream=True, n=2,
        messages=[{"role": "user", "content": "Count to five."}])
    got = {}
    for ch in st:
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
    log("chat stream n=2", got)
    r = B.completions.create(model="specdec", prompt="a b c a b c a b c a b", max_tokens=8, temperature=0)
    log("team-b ngram", repr(r.choices[0].text), r.model_extra.get("speculation_stats", {}).get("k_per_step"))

