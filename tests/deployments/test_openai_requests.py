"""The OpenAI body -> core request translation (:func:`deployments.openai_requests.translate`)
and the chat template's own refusals, without Ray, a Router or a model: fields whose only
honoured value is "nothing asked" are taken with that value alone, any other value (a wrong JSON
type included) is 400 naming the field; messages the target's chat template refuses are 400, not
an internal error. The same bodies through the served app: ``test_openai_api.py``."""

from __future__ import annotations

import pytest

from deployments.grpc_status import status_for
from deployments.openai_errors import error_message, error_param, http_status_for
from deployments.openai_requests import translate
from specdec.engine.prompt import encode_prompt
from specdec.errors import InvalidRequestError
from specdec.request import parse_request
from specdec.testing.tiny import build_tiny_tokenizer

MODEL = "specdec"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "hi"}


def _refusal(endpoint: str, body: dict) -> tuple[str, str | None]:
    with pytest.raises(InvalidRequestError) as e:
        translate(body, endpoint, [MODEL])
    assert http_status_for(e.value) == 400
    return error_message(e.value, endpoint, body), error_param(e.value, endpoint, body)


@pytest.mark.parametrize("endpoint, extra", [
    ("chat", {"tools": []}),
    ("chat", {"tool_choice": "none"}),
    ("chat", {"tools": [], "tool_choice": "none", "parallel_tool_calls": True}),
    ("chat", {"parallel_tool_calls": False}),
    ("chat", {"response_format": {"type": "text"}}),
    ("completions", {"echo": False}),
    ("completions", {"suffix": ""}),
    ("completions", {"best_of": 1}),
    ("completions", {"n": 3, "best_of": 3}),
    ("chat", {"tools": None, "echo": None}),  # JSON null: not set
])
def test_the_no_op_values_are_accepted_and_change_nothing(endpoint, extra):
    base = CHAT if endpoint == "chat" else COMPLETION
    plain = translate(base, endpoint, [MODEL])
    got = translate({**base, **extra}, endpoint, [MODEL])
    assert got.data == plain.data and got.n == extra.get("n", 1)
    parse_request(got.choice_data(0))


@pytest.mark.parametrize("endpoint, extra, message, param", [
    # were accepted and ignored: malformed bodies answered as if well formed
    ("chat", {"tools": "none"}, "tools: tool calls are not supported (only [] is accepted)", "tools"),
    ("chat", {"tool_choice": []}, 'tool_choice: tool calls are not supported (only "none" is accepted)',
     "tool_choice"),
    ("chat", {"parallel_tool_calls": "yes"}, "parallel_tool_calls must be true or false, got 'yes'",
     "parallel_tool_calls"),
    ("completions", {"echo": 0}, "echo must be true or false, got 0", "echo"),
    ("completions", {"suffix": 0}, "suffix must be a string, got 0", "suffix"),
    ("completions", {"suffix": []}, "suffix must be a string, got []", "suffix"),
    ("completions", {"best_of": True}, "best_of must be a whole number, got True", "best_of"),
    ("completions", {"best_of": 1.0}, "best_of must be a whole number, got 1.0", "best_of"),
    # refused before too (pinned: a value that asks for something is never ignored)
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools: tool calls are not supported (only [] is accepted)", "tools"),
    ("chat", {"tool_choice": "auto"}, 'tool_choice: tool calls are not supported (only "none" is accepted)',
     "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, 'response_format: only {"type": "text"} is supported',
     "response_format"),
    ("chat", {"functions": [{"name": "f"}]}, "unsupported field(s): functions", "functions"),
    ("completions", {"echo": True}, "echo is not supported", "echo"),
    ("completions", {"suffix": "}"}, "suffix is not supported", "suffix"),
    ("completions", {"best_of": 2}, "best_of other than n is not supported", "best_of"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content: only text parts are supported", "messages.0.content"),
    ("completions", {"prompt": ["a", "b"]},
     "prompt: a batch of several prompts is not supported; send one prompt per request", "prompt"),
])
def test_other_values_are_400_naming_the_field(endpoint, extra, message, param):
    base = CHAT if endpoint == "chat" else COMPLETION
    assert _refusal(endpoint, {**base, **extra}) == (message, param)


ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_messages_the_chat_template_refuses_are_a_bad_request_not_an_internal_error():
    """A template's ``raise_exception`` (Mistral's and Llama 2's "roles must alternate", Gemma's
    "System role not supported") escaped as jinja2's TemplateError: HTTP 500 / INTERNAL with
    "internal error (TemplateError); see the server log", for a request the caller must change."""
    tok = build_tiny_tokenizer()
    tok.chat_template = ALTERNATING
    ok = parse_request({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                     {"role": "user", "content": "c"}]})
    assert encode_prompt(tok, ok, len(tok)) == tok.encode(tok.apply_chat_template(
        [m.model_dump() for m in ok.messages], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    bad = parse_request({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    with pytest.raises(InvalidRequestError) as e:
        encode_prompt(tok, bad, len(tok))
    message = ("messages: the target's chat template refuses them: "
               "Conversation roles must alternate user/assistant/user/assistant/...")
    assert str(e.value) == message
    assert http_status_for(e.value) == 400 and status_for(e.value).name == "INVALID_ARGUMENT"
    assert error_message(e.value, "chat") == message and error_param(e.value, "chat") == "messages"


@pytest.mark.parametrize("template, error", [
    ("{% for m in messages %}", "TemplateSyntaxError"),  # does not parse: every chat request fails
    ("{{ no_such_variable.field }}", "UndefinedError"),  # a TemplateError subclass: the template's bug
])
def test_a_broken_chat_template_stays_the_servers_error(template, error):
    """Only the template's own ``raise_exception`` (exactly jinja's TemplateError) is the caller's
    400; a template that does not parse, or fails on its own bug (an undefined variable: a
    TemplateError subclass), is the server's fault: raised as is, not turned into the caller's 400."""
    import jinja2.exceptions

    tok = build_tiny_tokenizer()
    tok.chat_template = template
    req = parse_request({"messages": [{"role": "user", "content": "a"}]})
    with pytest.raises(getattr(jinja2.exceptions, error)):
        encode_prompt(tok, req, len(tok))


def test_text_parts_are_joined_with_a_newline_as_vllm_does():
    """A message's text parts become one content string, one newline between non-empty parts (vLLM's
    "string" content format skips empty parts), so a client sees the prompt, and the answer, it
    gets there; a one-part list is that part's text, an empty list or only empty parts ""."""
    def part(t):
        return {"type": "text", "text": t}

    got = translate({"model": MODEL, "messages": [
        {"role": "system", "content": [part("Hello")]},
        {"role": "user", "content": [part("Hello"), part(""), part("World"), part("")]},
        {"role": "assistant", "content": []}, {"role": "user", "content": [part("")]}]}, "chat", [MODEL])
    assert [m["content"] for m in got.data["messages"]] == ["Hello", "Hello\nWorld", "", ""]
    plain = translate({"model": MODEL, "messages": [{"role": "user", "content": "Hello\nWorld"}]}, "chat", [MODEL])
    assert plain.data["messages"][0] == got.data["messages"][1]


def test_completion_top_logprobs_hold_the_chosen_token_too():
    """Completions' ``top_logprobs[j]`` holds the N most likely tokens and, when it is not among
    them, the token chosen at j with its logprob (up to N + 1 entries, as OpenAI's legacy
    completions and vLLM), so ``top_logprobs[j][tokens[j]]`` never raises KeyError."""
    from deployments.openai_responses import TokenText, completion_logprobs
    from protos.specdec.v1 import specdec_pb2 as pb

    text = TokenText(build_tiny_tokenizer())
    top = [pb.TopLogprobs(ids=[5, 6], logprobs=[-0.125, -2.5]), pb.TopLogprobs(ids=[7, 8], logprobs=[-0.25, -1.875])]
    got = completion_logprobs([5, 9], [-0.125, -4.25], text, [0, 1], top, 2)
    assert got["tokens"] == [text(5), text(9)]
    assert got["top_logprobs"] == [{text(5): -0.125, text(6): -2.5}, {text(7): -0.25, text(8): -1.875, text(9): -4.25}]
    # float32 on the wire: values exact in binary
    assert [d[t] for d, t in zip(got["top_logprobs"], got["tokens"])] == [-0.125, -4.25]
    assert completion_logprobs([], [], text, [], [], 2)["top_logprobs"] == []
    # the chosen id decodes like a more likely one (two lone bytes >= 0x80: both U+FFFD): one key,
    # the more likely id's logprob, as for alternatives alike
    hi = [i for i in range(len(text.tokenizer)) if text(i) == "\ufffd"][:2]
    assert len(hi) == 2
    same = completion_logprobs([hi[1]], [-3.0], text, [0], [pb.TopLogprobs(ids=[hi[0]], logprobs=[-0.5])], 1)
    assert same["top_logprobs"] == [{"\ufffd": -0.5}] and same["tokens"] == ["\ufffd"]
    assert completion_logprobs([5], [-0.1], text, [0])["top_logprobs"] is None  # logprobs 0: no alternatives


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_chunks_carry_usage_null_with_include_usage(endpoint):
    """With ``stream_options.include_usage`` every chunk before the usage chunk has ``"usage": null``
    (OpenAI's streaming spec); without it no chunk has the key."""
    from deployments.openai_responses import TextOffsets, TokenText, stream_chunk
    from protos.specdec.v1 import specdec_pb2 as pb

    text = TokenText(build_tiny_tokenizer())
    base = CHAT if endpoint == "chat" else COMPLETION
    chunk = pb.GenerateStreamChunk(text="ab", token_ids=[5, 6])
    for include, expected in ((True, {"usage": None}), (False, {})):
        req = translate({**base, "stream": True, "stream_options": {"include_usage": include}}, endpoint, [MODEL])
        got = stream_chunk(req, 0, chunk, text, TextOffsets(text), first=True)
        assert {k: got[k] for k in ("usage",) if k in got} == expected
        assert got["choices"][0]["token_ids"] == [5, 6]


def test_a_logit_bias_id_given_twice_is_400_not_one_bias_dropped():
    """JSON object keys are strings: ``{"7": 5, "07": -5}`` names token 7 twice, and the core's
    ``dict[int, float]`` kept one of the two biases silently; it is 400 naming both keys."""
    body = {**CHAT, "logit_bias": {"7": 5, "07": -5}}
    assert _refusal("chat", body) == ("logit_bias: token id 7 is given twice ('7' and '07')", "logit_bias")
    ok = translate({**COMPLETION, "logit_bias": {"7": 5, "8": -5}}, "completions", [MODEL])
    assert parse_request(ok.choice_data(0)).sampling.logit_bias == {7: 5.0, 8: -5.0}


def test_an_unknown_model_is_404_with_openais_code():
    """A ``model`` this server does not serve is 404 with ``code: model_not_found`` (OpenAI's code
    for it), the message naming the served one."""
    from deployments.openai_errors import error_code
    from specdec.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError) as e:
        translate({**CHAT, "model": "gpt-4o"}, "chat", [MODEL])
    assert http_status_for(e.value) == 404 and error_code(e.value) == "model_not_found"
    assert str(e.value) == "the model 'gpt-4o' does not exist; this server serves 'specdec'"
    assert error_code(InvalidRequestError("top_p: bad")) is None
