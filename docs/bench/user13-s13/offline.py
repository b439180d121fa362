import json
from deployments.openai_requests import translate
from deployments.openai_errors import error_response
from specdec.request import parse_request
P,C="completions","chat"
cases = [
    ("empty prompt", P, {"model": "specdec", "prompt": "", "max_tokens": 4}),
    ("empty messages", C, {"model": "specdec", "messages": [], "max_tokens": 4}),
    ("huge max_tokens", P, {"model": "specdec", "prompt": "hi", "max_tokens": 10**12}),
    ("max_tokens 0", P, {"model": "specdec", "prompt": "hi", "max_tokens": 0}),
    ("wrong model", P, {"model": "gpt-4", "prompt": "hi", "max_tokens": 4}),
    ("no model", P, {"prompt": "hi", "max_tokens": 4}),
    ("neg temperature", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "temperature": -0.5}),
    ("temperature 3", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "temperature": 3}),
    ("top_p 0", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "top_p": 0}),
    ("n 0", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "n": 0}),
    ("n 100", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "n": 100}),
    ("seed -1", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "seed": -1, "temperature": 1}),
    ("seed 2**64", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "seed": 2**64, "temperature": 1}),
    ("prompt ids bad", P, {"model": "specdec", "prompt": [10**9], "max_tokens": 4}),
    ("prompt ids negative", P, {"model": "specdec", "prompt": [-1], "max_tokens": 4}),
    ("prompt ids empty", P, {"model": "specdec", "prompt": [], "max_tokens": 4}),
    ("prompt list of strings", P, {"model": "specdec", "prompt": ["a", "b"], "max_tokens": 4}),
    ("prompt list of one string", P, {"model": "specdec", "prompt": ["a"], "max_tokens": 4}),
    ("max_tokens string", P, {"model": "specdec", "prompt": "hi", "max_tokens": "5"}),
    ("max_tokens float", P, {"model": "specdec", "prompt": "hi", "max_tokens": 5.0}),
    ("max_tokens 5.5", P, {"model": "specdec", "prompt": "hi", "max_tokens": 5.5}),
    ("best_of", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "best_of": 3}),
    ("best_of 1", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "best_of": 1}),
    ("echo", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "echo": True}),
    ("echo false", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "echo": False}),
    ("logit_bias bad id", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logit_bias": {"abc": 1}}),
    ("logit_bias huge id", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logit_bias": {"99999999": 1}}),
    ("logit_bias 1000", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logit_bias": {"13": 1000}}),
    ("logit_bias nan-ish string", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logit_bias": {"13": "x"}}),
    ("logprobs 30", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logprobs": 30}),
    ("logprobs true (completions)", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "logprobs": True}),
    ("chat top_logprobs w/o logprobs", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("chat top_logprobs 21", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}),
    ("stop 5 strings", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "stop": ["a", "b", "c", "d", "e"]}),
    ("stop empty string", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "stop": [""]}),
    ("stop empty str scalar", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "stop": ""}),
    ("stop list empty", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "stop": []}),
    ("role bad", C, {"model": "specdec", "messages": [{"role": "robot", "content": "hi"}], "max_tokens": 4}),
    ("content list", C, {"model": "specdec", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 4}),
    ("content null", C, {"model": "specdec", "messages": [{"role": "user", "content": None}], "max_tokens": 4}),
    ("assistant content null", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "max_tokens": 4}),
    ("message name", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 4}),
    ("messages not list", C, {"model": "specdec", "messages": "hi", "max_tokens": 4}),
    ("message not dict", C, {"model": "specdec", "messages": ["hi"], "max_tokens": 4}),
    ("tools", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": []}),
    ("response_format", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {"type": "json_object"}}),
    ("response_format text", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {"type": "text"}}),
    ("max_k 99", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "speculation": {"max_k": 99}}),
    ("speculation unknown", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "speculation": {"k": 3}}),
    ("proposer bogus", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "speculation": {"proposer": "eagle"}}),
    ("body list", P, [1, 2]),
    ("NaN temperature", P, json.loads('{"model": "specdec", "prompt": "hi", "max_tokens": 4, "temperature": NaN}')),
    ("Infinity top_p", P, json.loads('{"model": "specdec", "prompt": "hi", "max_tokens": 4, "top_p": Infinity}')),
    ("Infinity presence", P, json.loads('{"model": "specdec", "prompt": "hi", "max_tokens": 4, "presence_penalty": Infinity}')),
    ("NaN logit bias", P, json.loads('{"model": "specdec", "prompt": "hi", "max_tokens": 4, "logit_bias": {"13": NaN}}')),
    ("surrogate prompt", P, json.loads('{"model": "specdec", "prompt": "hi \\ud800", "max_tokens": 4}')),
    ("presence 3", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "presence_penalty": 3}),
    ("top_k 0", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "top_k": 0}),
    ("top_k -2", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "top_k": -2}),
    ("stream_options without stream", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "stream_options": {"include_usage": True}}),
    ("user int", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "user": 5}),
    ("max_completion_tokens + max_tokens", C, {"model": "specdec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_completion_tokens": 8}),
    ("stop_token_ids bad", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "stop_token_ids": [-5]}),
    ("min_tokens > max", P, {"model": "specdec", "prompt": "hi", "max_tokens": 4, "min_tokens": 10}),
]
for label, ep, body in cases:
    try:
        r = translate(body, ep, ["specdec"])
        req = parse_request(r.data) if hasattr(r, "data") else None
        print(f"{label:34s} OK  n={getattr(r,'n',None)} data={str(r.data)[:150]}")
    except Exception as e:
        resp = error_response(e, ep, body if isinstance(body, dict) else None)
        print(f"{label:34s} {resp.status_code} {resp.body.decode()[:220]}")
