"""vLLM's `cache_salt` (a prompt dict's key in the Python API, a field of the server's bodies and of batch lines):
requests share prefix-cache blocks only with requests of the same salt, so that one tenant cannot learn another's
prompts from cache hits (time to first token). infer took the field and ignored it: every tenant shared every block.
A bad salt (empty, not a string) is refused naming the field."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.errors import RequestError

PROMPT = list(range(5, 41))  # 36 tokens: 9 full blocks of 4
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", block_size=4, max_model_len=128)


def _hits(llm) -> int:
    return llm.engine.stats()["prefix_cache_hits"]


def _run(llm, prompt, params=PARAMS) -> tuple[list[int], int]:
    before = _hits(llm)
    out = llm.generate([prompt], params)[0]
    return out.token_ids, _hits(llm) - before


def test_only_requests_of_the_same_salt_share_prefix_blocks(llm):
    assert llm.reset_prefix_cache() is True
    first, hits = _run(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"})
    assert hits == 0
    assert _run(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}) == (first, 0), "another salt: no hit"
    assert _run(llm, PROMPT) == (first, 0), "no salt: no hit on a salted prefix"
    same, hits = _run(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"})
    assert same == first and hits >= 32
    # SamplingParams(cache_salt=...) is the same salt; an unsalted request hits the unsalted run's blocks
    assert _run(llm, PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True, cache_salt="tenant-a"))[1] >= 32
    assert _run(llm, {"prompt_token_ids": PROMPT})[1] >= 32


def test_text_prompts_and_the_engine_api_take_the_salt(llm):
    assert llm.reset_prefix_cache() is True
    text = "hello there, general kenobi, you are a bold one indeed " * 2
    _, hits = _run(llm, {"prompt": text, "cache_salt": "s1"})
    assert hits == 0 and _run(llm, {"prompt": text, "cache_salt": "s2"})[1] == 0
    assert _run(llm, {"prompt": text, "cache_salt": "s1"})[1] > 0
    engine = llm.engine
    engine.add_request("salted", {"prompt_token_ids": PROMPT, "cache_salt": "fresh"}, PARAMS)
    assert engine.requests["salted"].params.cache_salt == "fresh"
    while engine.has_unfinished_requests():
        engine.step()


def test_a_params_list_given_by_the_caller_is_not_changed(llm):
    params = [SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=2)]
    llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": "x"}, PROMPT], params)
    assert all(p.cache_salt is None for p in params)


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_a_bad_salt_is_refused_naming_it(llm, salt):
    with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": salt}], PARAMS)
    with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt=salt)


def test_the_server_salts_the_cache_and_refuses_a_bad_salt():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, block_size=4))
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}

    def hits_of(extra: dict) -> int:
        before = engine.stats()["prefix_cache_hits"]
        r = client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        return engine.stats()["prefix_cache_hits"] - before

    with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama"))) as client:
        assert hits_of({"cache_salt": "a"}) == 0
        assert hits_of({"cache_salt": "b"}) == 0 and hits_of({}) == 0
        assert hits_of({"cache_salt": "a"}) >= 32
        r = client.post("/v1/completions", json={**body, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "cache_salt": 7})
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], r.text


def test_batch_lines_take_the_salt(tmp_path):
    from typer.testing import CliRunner

    from infer.cli.main import app
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt_token_ids": [5, 6, 7, 8], "cache_salt": "x", "max_new_tokens": 2}\n'
                   '{"id": "b", "prompt_token_ids": [5, 6, 7, 8], "cache_salt": "", "max_new_tokens": 2}\n')
    res = CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "out.jsonl"), "-q"])
    out = (tmp_path / "out.jsonl").read_text()
    assert '"id": "a"' in out and "cache_salt must be a non-empty string" in out, (res.output, out)


def test_reset_prefix_cache_forgets_the_prefixes_and_keeps_counting(llm):
    """vLLM's LLM.reset_prefix_cache (and LLMEngine's): an AttributeError before."""
    _run(llm, PROMPT)
    assert _run(llm, PROMPT)[1] >= 32
    before = _hits(llm)
    assert llm.reset_prefix_cache() is True
    assert _hits(llm) == before, "the counters only grow (/metrics counts them)"
    assert _run(llm, PROMPT)[1] == 0
    assert llm.llm_engine.reset_prefix_cache() is True and _run(llm, PROMPT)[1] == 0


def test_a_priority_other_than_0_is_refused_by_the_server_and_batch_lines(tmp_path):
    """The Python API refused priority != 0 (first come, first served), the server took it and ignored it; vLLM
    without its priority scheduling answers 400 too."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=64, block_size=4))
    with TestClient(create_app(Server(AsyncEngine(engine), "tiny-llama"))) as client:
        for priority, status in ((0, 200), (None, 200), (3, 400), (-1, 400), (True, 400)):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": priority})
            assert r.status_code == status, (priority, r.text)
            if status == 400:
                assert r.json()["error"]["param"] == "priority", r.text
                assert ("first come, first served" in r.text) == (priority is not True), r.text
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", '
                   '"max_tokens": 2, "priority": 2}}\n')
    CliRunner().invoke(app, ["run", "tiny-llama", str(inp), "-o", str(tmp_path / "out.jsonl"), "-q"])
    assert "first come, first served" in (tmp_path / "out.jsonl").read_text()
