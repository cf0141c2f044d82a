"""vLLM's --chat-template (infer run / serve / bench, `LLM(model, chat_template=...)`), `LLM.chat(chat_template=...)`
and the server's --trust-request-chat-template: a model whose tokenizer has no template (the built-in tiny model's
folder without it) renders chat messages with the one given, a file or the text itself, into exactly the prompt ids
transformers' `apply_chat_template(messages, chat_template=T, add_generation_prompt=True)` gives; a value that is
neither a file nor a template is refused naming the option, and a request's own template is used only where the
server trusts it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from transformers import AutoTokenizer  # noqa: E402

from infer import LLM, SamplingParams  # noqa: E402
from infer.cli.main import app  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.errors import ConfigError, RequestError  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402

runner = CliRunner()

# another template than the built-in model's, so that the ids say which one rendered them
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
OTHER = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
PARTS = ("{% for m in messages %}{% for p in m['content'] %}({{ p['text'] }}){% endfor %}{% endfor %}"
         "{% if add_generation_prompt %}=>{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how is the weather today"}]


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> str:
    """The built-in tiny model without a chat template."""
    path = tmp_path_factory.mktemp("bare") / "tiny-bare"
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(path).chat_template is None
    return str(path)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def _oracle(model: str, template: str | None = None, messages=MESSAGES) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model)
    return list(tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


# ------------------------------------------------------------------------------------------ the value's rule
def test_a_file_or_the_text_itself_and_clear_errors_otherwise(tmp_path, template_file):
    assert EngineConfig("tiny-llama", chat_template=str(template_file)).chat_template == TEMPLATE
    assert EngineConfig("tiny-llama", chat_template=template_file).chat_template == TEMPLATE  # a Path too
    cfg = EngineConfig("tiny-llama", chat_template=OTHER)
    assert cfg.chat_template == OTHER
    assert dataclasses.replace(cfg, seed=3).chat_template == OTHER  # read again: the same text
    assert EngineConfig("tiny-llama").chat_template is None

    with pytest.raises(ConfigError) as e:
        EngineConfig("tiny-llama", chat_template=str(tmp_path / "missing.jinja"))
    assert "--chat-template" in e.value.message and "neither an existing file nor a template" in e.value.message
    assert "Jinja file" in e.value.hint
    with pytest.raises(ConfigError) as e:
        EngineConfig("tiny-llama", chat_template=str(tmp_path))
    assert "is a folder" in e.value.message
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}")  # no endfor
    with pytest.raises(ConfigError) as e:
        EngineConfig("tiny-llama", chat_template=str(broken))
    assert "not a valid Jinja template" in e.value.message and str(broken) in e.value.message
    plain = tmp_path / "notes.txt"
    plain.write_text("just words")
    with pytest.raises(ConfigError, match="holds no Jinja"):
        EngineConfig("tiny-llama", chat_template=str(plain))
    with pytest.raises(ConfigError, match="must be a file path or the template text"):
        EngineConfig("tiny-llama", chat_template=3)


# ------------------------------------------------------------------------------------------------ Python API
def test_llm_with_a_template_chats_with_a_model_that_has_none(bare, template_file):
    want = _oracle(bare, TEMPLATE)
    params = SamplingParams(max_new_tokens=3)
    with LLM(bare, chat_template=str(template_file), block_size=4) as llm:
        assert llm.chat(MESSAGES, params)[0].prompt_token_ids == want
        assert llm.tokenizer.chat_template == TEMPLATE
        # a call's own template wins over the model's, the text itself or a file
        assert llm.chat(MESSAGES, params, chat_template=OTHER)[0].prompt_token_ids == _oracle(bare, OTHER)
        assert llm.chat(MESSAGES, params)[0].prompt_token_ids == want  # and only for that call
    with LLM(bare, block_size=4) as llm:
        with pytest.raises(RequestError) as e:
            llm.chat(MESSAGES, params)
        assert "no chat template" in e.value.message and "--chat-template" in e.value.hint
        out = llm.chat(MESSAGES, params, chat_template=str(template_file))[0]
        assert out.prompt_token_ids == want
        with pytest.raises(RequestError, match="chat_template 'nope' is neither an existing file nor a template"):
            llm.chat(MESSAGES, params, chat_template="nope")


def test_llm_chat_per_call_template_over_the_models_own():
    params = SamplingParams(max_new_tokens=2)
    model = str(ensure_builtin("tiny-llama"))
    with LLM("tiny-llama", block_size=4) as llm:
        assert llm.chat(MESSAGES, params)[0].prompt_token_ids == _oracle(model)
        outs = llm.chat([MESSAGES, MESSAGES[1:]], params, chat_template=OTHER)
        assert [o.prompt_token_ids for o in outs] == [_oracle(model, OTHER), _oracle(model, OTHER, MESSAGES[1:])]
        assert _oracle(model, OTHER) != _oracle(model)
        # a call's template that loops over OpenAI's content parts gets them as a list (vLLM's "openai" format),
        # found in that template, not in the model's (which prints the content as a string)
        parts = [{"role": "user", "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "sun"}]}]
        out = llm.chat(parts, params, chat_template=PARTS)[0]
        assert out.prompt_token_ids == _oracle(model, PARTS, parts)


# ------------------------------------------------------------------------------------------------- infer run
def _write(path: Path, lines: list) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_run_renders_messages_with_the_option(tmp_path, bare, template_file):
    want = _oracle(bare, TEMPLATE)
    lines = [{"id": "chat", "messages": MESSAGES, "max_new_tokens": 4, "prompt_logprobs": 1},
             {"id": "ids", "prompt_token_ids": want, "max_new_tokens": 4, "prompt_logprobs": 1},
             {"custom_id": "batch", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1}}]
    inp = _write(tmp_path / "in.jsonl", lines)
    for i, value in enumerate([str(template_file), TEMPLATE]):  # the file, then the text itself
        out = tmp_path / f"out{i}.jsonl"
        res = runner.invoke(app, ["run", bare, str(inp), "-o", str(out), "-q", "--chat-template", value])
        assert res.exit_code == 0, res.output
        recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        for name in ("chat", "batch"):
            r = recs[name]
            assert r["error"] is None and r["usage"]["prompt_tokens"] == len(want)
            assert [p["token_id"] for p in r["prompt_logprobs"][1:]] == want[1:]
            assert r["token_ids"] == recs["ids"]["token_ids"]
    out = tmp_path / "none.jsonl"
    res = runner.invoke(app, ["run", bare, str(inp), "-o", str(out), "-q"])  # no template: chat lines fail
    assert res.exit_code == 1
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "no chat template" in recs["chat"]["error"] and "--chat-template" in recs["chat"]["error"]
    assert recs["ids"]["error"] is None


def test_run_strict_reads_the_lines_with_the_template(tmp_path, bare, template_file):
    inp = _write(tmp_path / "in.jsonl", [{"id": "chat", "messages": MESSAGES, "max_new_tokens": 2}])
    res = runner.invoke(app, ["run", bare, str(inp), "-o", str(tmp_path / "o.jsonl"), "-q", "--strict",
                              "--chat-template", str(template_file)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", bare, str(inp), "-o", str(tmp_path / "p.jsonl"), "-q", "--strict"])
    assert res.exit_code == 2 and "--chat-template" in res.output


def test_a_line_cannot_bring_its_own_template(tmp_path):
    inp = _write(tmp_path / "in.jsonl", [{"custom_id": "x", "body": {"messages": MESSAGES, "chat_template": OTHER}}])
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q"])
    assert res.exit_code == 1
    error = json.loads(out.read_text())["error"]
    assert "body.chat_template" in error and "--chat-template" in error


@pytest.mark.parametrize("command", [["run", "tiny-llama", "IN"], ["serve", "tiny-llama"],
                                     ["bench", "tiny-llama", "--quiet"]])
def test_a_value_that_is_neither_file_nor_template_is_a_bad_option(tmp_path, command):
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    argv = [str(inp) if a == "IN" else a for a in command]
    missing = str(tmp_path / "nope.jinja")
    res = runner.invoke(app, [*argv, "--chat-template", missing])
    assert res.exit_code == 2, res.output
    assert "--chat-template" in res.output and "neither an existing file nor a template" in res.output


def test_run_resume_refuses_another_template(tmp_path, template_file):
    inp = _write(tmp_path / "in.jsonl", [{"id": "a", "messages": MESSAGES, "max_new_tokens": 2}])
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--chat-template", OTHER])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", "tiny-llama", str(inp), "-o", str(out), "-q", "--resume",
                              "--chat-template", str(template_file)])
    assert res.exit_code == 2 and "chat_template" in res.output, res.output


def test_bench_renders_the_workload_with_the_option(tmp_path, bare, template_file, monkeypatch):
    plans = []
    monkeypatch.setattr("infer.bench.plan.run_plan", lambda plan, **kw: (plans.append(plan), (None, False))[1])
    work = _write(tmp_path / "w.jsonl", [{"messages": MESSAGES}])
    res = runner.invoke(app, ["bench", bare, "-c", "1", "--dataset", f"jsonl:{work}", "--quiet", "--out",
                              str(tmp_path / "b"), "--chat-template", str(template_file)])
    assert res.exit_code == 0, res.output
    from infer.bench.datasets import load_workload
    from infer.bench.plan import load_plan_tokenizer
    tok = load_plan_tokenizer(plans[0])
    assert plans[0].engine.chat_template == TEMPLATE and tok.chat_template == TEMPLATE
    reqs = load_workload(f"jsonl:{work}", tok, output_len=4).requests
    assert reqs[0].prompt_token_ids == _oracle(bare, TEMPLATE)


# ----------------------------------------------------------------------------------------------- infer serve
def test_serve_passes_the_template_and_the_trust_flag(template_file, monkeypatch):
    seen = {}
    monkeypatch.setattr("infer.cli.serve._serve", lambda engine, *a, **kw: seen.update(engine=engine, **kw))
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0", "--chat-template", str(template_file),
                              "--trust-request-chat-template"])
    assert res.exit_code == 0, res.output
    assert seen["engine"].chat_template == TEMPLATE and seen["trust_request_chat_template"] is True
    res = runner.invoke(app, ["serve", "tiny-llama", "--port", "0"])
    assert res.exit_code == 0, res.output
    assert seen["engine"].chat_template is None and seen["trust_request_chat_template"] is False


@pytest.fixture(scope="module")
def servers(bare, template_file):
    """(the bare model served with --chat-template, with it and --trust-request-chat-template, without it)."""
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine

    def server(template, trust):
        engine = LLMEngine(EngineConfig(bare, chat_template=template, block_size=4, max_num_seqs=4))
        return serve_in_thread(Server(AsyncEngine(engine), "bare", trust_request_chat_template=trust))
    with server(str(template_file), False) as plain, server(TEMPLATE, True) as trusting, \
            server(None, False) as without:
        yield plain, trusting, without


def _chat(base, **extra):
    return httpx.post(f"{base}/v1/chat/completions", timeout=120,
                      json={"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True, **extra})


def test_serve_renders_chat_with_the_option(servers, bare):
    want = _oracle(bare, TEMPLATE)
    for base in servers[:2]:
        r = _chat(base)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == want
        r = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] == want


def test_a_model_without_template_hints_the_option(servers):
    r = _chat(servers[2])
    assert r.status_code == 400
    assert "no chat template" in r.json()["error"]["message"] and "--chat-template" in r.json()["error"]["message"]


def test_a_requests_template_needs_the_trust_flag(servers, bare):
    plain, trusting, without = servers
    for base in (plain, without):
        for path, body in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
            r = httpx.post(f"{base}{path}", json={"messages": MESSAGES, "chat_template": OTHER, **body}, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    want = _oracle(bare, OTHER)
    r = _chat(trusting, chat_template=OTHER)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == want
    r = httpx.post(f"{trusting}/tokenize", json={"messages": MESSAGES, "chat_template": OTHER}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == want
    assert _chat(trusting).json()["choices"][0]["prompt_token_ids"] == _oracle(bare, TEMPLATE)  # that request only


@pytest.mark.parametrize("path,body,words", [
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": 5}, "must be the template's text"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": ""}, "must be the template's text"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{% for %}"}, "chat_template is not valid Jinja"),
    ("/v1/completions", {"prompt": "hi", "chat_template": OTHER}, "applies to chat messages only"),
])
def test_a_trusted_servers_bad_templates_are_400(servers, path, body, words):
    r = httpx.post(f"{servers[1]}{path}", json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------- data parallel
def test_data_parallel_run_renders_with_the_option(tmp_path, bare, template_file):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'infer[ray]')")
    want = _oracle(bare, TEMPLATE)
    inp = _write(tmp_path / "in.jsonl", [{"id": "chat", "messages": MESSAGES, "max_new_tokens": 3,
                                          "prompt_logprobs": 1},
                                         {"id": "ids", "prompt_token_ids": want, "max_new_tokens": 3}])
    out = tmp_path / "o.jsonl"
    res = runner.invoke(app, ["run", bare, str(inp), "-o", str(out), "-q", "--data-parallel", "2", "--device", "cpu",
                              "--chat-template", str(template_file)])
    assert res.exit_code == 0, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["chat"]["usage"]["prompt_tokens"] == len(want)
    assert [p["token_id"] for p in recs["chat"]["prompt_logprobs"][1:]] == want[1:]
    assert recs["chat"]["token_ids"] == recs["ids"]["token_ids"]
