"""``specdec generate`` as a new user calls it (tiny pair from a config; no Ray)."""

from __future__ import annotations

import json

import pytest

from specdec import cli
from tests.conftest import target_greedy


def test_generate_with_draft_none_defaults_to_prompt_lookup(tiny_dir, tiny_target, capsys):
    """``specdec generate --draft none PROMPT`` failed after loading the target with "proposer
    'draft' needs a draft model; none is loaded": the default proposer was the draft model
    whatever --draft said. It is now prompt lookup without a draft (as the server's default),
    and the output is the target alone's."""
    argv = ["generate", "--target", str(tiny_dir / "target"), "--draft", "none", "def f(",
            "--max-tokens", "6", "--temperature", "0", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == target_greedy(tiny_target, tiny_target.tokenizer.encode("def f("), 6)
    assert cli.main(argv[:-1]) == 0  # the summary line names the proposer
    assert ", proposer ngram, target float32 / no draft, K 4, " in capsys.readouterr().err


def test_generate_draft_proposer_without_a_draft_is_refused_before_loading(capsys):
    """``--proposer draft --draft none`` is refused at once (exit 2, what to use instead), not
    after loading the target: the target path here does not exist, and the message is not
    about it."""
    assert cli.main(["generate", "--target", "/nonexistent-target", "--draft", "none", "--proposer", "draft",
                     "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "specdec: error: --proposer draft needs a draft model; --draft none loads none "
        "(use --proposer ngram or none)")


@pytest.mark.parametrize("flags, message", [
    (["-k", "99"], "invalid request: -k: Input should be less than or equal to 16"),
    (["--seed", "-1", "--temperature", "1"], "invalid request: --seed: Input should be greater than or equal to 0"),
    (["--max-tokens", "0"], "invalid request: --max-tokens: Input should be greater than or equal to 1"),
    (["--top-p", "0"], "invalid request: --top-p: Input should be greater than 0"),
    # rules over several flags named the request fields ("top_logprobs needs logprobs")
    (["--top-logprobs", "3"], "invalid request: --top-logprobs needs --logprobs"),
    (["--stop", ""], "invalid request: --stop strings must not be empty"),
    (["--min-tokens", "9", "--max-tokens", "8"], "invalid request: --min-tokens (9) must be <= --max-tokens (8)"),
])
def test_generate_errors_name_the_flag(flags, message, capsys):
    """A bad value was reported by its request field (``speculation.k``, ``sampling.seed``), which
    the user of ``specdec generate`` never typed; it names the flag, before any model loads."""
    assert cli.main(["generate", "--target", "/nonexistent-target", "x", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"specdec: error: {message}"


def test_client_values_beyond_the_wire_are_a_clean_error_before_any_call(capsys):
    """``specdec client --seed 2**64`` was a ValueError traceback from protobuf (the field is
    uint64); then the client's INVALID_ARGUMENT line; now the usage error naming the flag and
    the server's own range, exit status 2, nothing sent (no server listens on the address)."""
    assert cli.main(["client", "x", "--seed", str(2**64), "--address", "localhost:1"]) == 2
    assert capsys.readouterr().err == "specdec client: --seed: Input should be less than 18446744073709551616\n"
    assert cli.main(["client", "x", "--max-tokens", str(2**32), "--address", "localhost:1"]) == 2
    assert capsys.readouterr().err == "specdec client: --max-tokens: Input should be less than or equal to 1000000\n"


def test_help_texts_name_the_defaults(capsys):
    """What a new user reads first: every flag that has a default says it."""
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("(default: demo:target)", "(default: demo:draft)", "(draft tokens per step; default: 4)",
                 "most tokens to generate; the prompt plus this must fit the target's context (default: 128, cut short at the "
                 "context)", "0 = greedy (default: 0)", "(default: a random one)"):
        assert text in out, text
    with pytest.raises(SystemExit):
        cli.main(["client", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("(host:port; default: localhost:9000)", "(default: specdec)", "(default: the server's)"):
        assert text in out, text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "The ``specdec`` command line" not in capsys.readouterr().out


def test_a_prompt_and_messages_together_are_refused(capsys):
    """``specdec generate PROMPT --message user:TEXT`` (and ``specdec client`` alike) answered the
    messages and dropped the prompt without a word; both together are now refused, exit 2,
    before any model loads or any call (nothing listens on the address)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--target", "/nonexistent-target", "def f(", "--message", "user:hi"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "specdec: error: generate takes a prompt or --message, not both (the prompt would be ignored)")
    assert cli.main(["client", "def f(", "--message", "user:hi", "--address", "localhost:1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "specdec client: give a prompt or --message, not both (the prompt would be ignored)")


def test_a_reader_that_goes_away_is_not_a_traceback():
    """``specdec client --tenant-stats | head`` printed a BrokenPipeError traceback once head had
    read its lines; a closed stdout now ends the command quietly with status 1. The subcommand
    here prints 100,000 lines (the real ones need a server) into a pipe nobody reads."""
    import os
    import subprocess
    import sys

    code = ("import sys; from specdec import cli; "
            "cli.registered_commands = lambda: {'spam': cli.Command('print lines', lambda p: None, "
            "lambda a: [print('line', i) for i in range(100_000)] and 0)}; sys.exit(cli.main(['spam']))")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 1


#: ``specdec generate``'s stats line, the numbers that vary from run to run as patterns
_STATS = (r"-- 6 tokens in \d+\.\d\d s \(\d+\.\d\d tokens/s\), finish: max_tokens, proposer {proposer}, {formats}, "
          r"K 4, steps \d+, acceptance rate (\d\.\d\d|n/a), mean accepted length \d+\.\d\d, "
          r"accepted per position \[[\d, ]*\], draft \d+\.\d\d s, verify \d+\.\d\d s")


def test_generate_names_the_weight_formats_that_ran(tiny_dir, tiny_target, tiny_draft_close, capsys, monkeypatch):
    """The stats line and --json named no weight format (``specdec serve`` logs them): they now name
    the formats the models were loaded in (resolved: a flag, else $SPECDEC_WEIGHT_FORMAT, read
    case-insensitively), the draft's None / "no draft" when no draft model runs."""
    import re

    target, draft = str(tiny_dir / "target"), str(tiny_dir / "draft_close")
    base = ["generate", "--target", target, "--draft", draft, "def f(", "--max-tokens", "6"]
    assert cli.main(base + ["--draft-format", "bfloat16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["target_format"], out["draft_format"]) == ("float32", "bfloat16")  # float32: tests/conftest.py
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", " BFloat16 ")
    assert cli.main(base) == 0
    err = capsys.readouterr().err.splitlines()[-1]  # after transformers' progress bars
    assert re.fullmatch(_STATS.format(proposer="draft", formats="target bfloat16 / draft bfloat16"), err), err
    monkeypatch.setenv("SPECDEC_WEIGHT_FORMAT", "float32")
    for extra in (["--proposer", "ngram"], ["--draft", "none"]):  # no draft model loaded
        assert cli.main(base + extra + ["--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["target_format"], out["draft_format"]) == ("float32", None)
        assert cli.main(base + extra) == 0
        err = capsys.readouterr().err.splitlines()[-1]
        assert re.fullmatch(_STATS.format(proposer="ngram", formats="target float32 / no draft"), err), err


def _no_weights(monkeypatch):
    """Make every weight load fail the test."""
    from specdec.models import loader

    def refuse(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(loader, "load_pair", refuse)
    monkeypatch.setattr(loader.AutoModelForCausalLM, "from_pretrained", refuse)


def test_generate_refuses_a_request_over_the_context_before_loading_weights(tiny_dir, tiny_target,
                                                                            tiny_draft_close, capsys, monkeypatch):
    """A prompt plus --max-tokens over the target's context was refused only after both models
    loaded (20-28 s for the demo pair); it is now refused from the tokenizer and config files,
    no weight loaded, with the engine's message (exit 2)."""
    target, draft = str(tiny_dir / "target"), str(tiny_dir / "draft_close")
    assert len(tiny_target.tokenizer.encode("def f(")) == 3 and tiny_target.max_positions == 256
    _no_weights(monkeypatch)
    for drafts in (["--draft", draft], ["--draft", "none"]):
        assert cli.main(["generate", "--target", target, *drafts, "def f(", "--max-tokens", "254"]) == 2
        assert capsys.readouterr().err.strip() == (
            "specdec: error: This model's maximum context length is 256 tokens. However, you requested 257 tokens "
            "(3 in the prompt, 254 in the completion). Please reduce the length of the prompt or completion.")
    assert cli.main(["generate", "--target", target, "--message", "user:" + "def f(" * 100]) == 2
    assert capsys.readouterr().err.strip() == (
        f"specdec: error: prompt is 317 tokens but the target '{target}' holds 256 positions; "
        "at most 255 prompt tokens leave room for one generated token")
    with pytest.raises(AssertionError, match="weights loaded"):  # one that fits goes on to load
        cli.main(["generate", "--target", target, *drafts, "def f(", "--max-tokens", "253"])
