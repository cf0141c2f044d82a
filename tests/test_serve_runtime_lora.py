"""`infer serve --allow-runtime-lora`: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and
bodies). A loaded adapter is listed by /v1/models and picked by `model` with peft's tokens; an unloaded one gets 404
at once while a stream already running with it finishes with peft's tokens; bad bodies, bad folders, names taken and
a server without the flag each get their own 4xx; the routes need the API key."""

from __future__ import annotations

import threading

import pytest

httpx = pytest.importorskip("httpx")  # the serve extra
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.models.tiny import ensure_builtin  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from helpers import serve_process  # noqa: E402
from lora_helpers import PeftOracle, three_adapters  # noqa: E402

PROMPT = [5, 17, 99, 230, 41, 7]
N = 10


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return three_adapters(tmp_path_factory.mktemp("serve-runtime-lora"), seed=20)


@pytest.fixture(scope="module")
def oracle(paths):
    hf, adapters = paths
    return PeftOracle(hf, adapters)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig("tiny-llama", max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8))


@pytest.fixture(scope="module")
def url(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama", runtime_lora=True)) as base:
        yield base


def _load(url, name, path, **kw):
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, **kw)


def _unload(url, name, **kw):
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, **kw)


def _tokens(client, model, n=N):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"]


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_load_serve_unload_with_peft_tokens(url, client, paths, oracle):
    _, adapters = paths
    r = _load(url, "a", adapters["a"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully."
    assert _load(url, "b", adapters["b"]).status_code == 200
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny-llama", "a", "b"} and cards["a"].model_extra["parent"] == "tiny-llama"
    assert _tokens(client, "a") == oracle.greedy("a", PROMPT, N)
    assert _tokens(client, "b") == oracle.greedy("b", PROMPT, N)
    assert _tokens(client, "tiny-llama") == oracle.greedy(None, PROMPT, N)

    r = _unload(url, "a")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' removed successfully."
    with pytest.raises(openai.NotFoundError, match="'a' does not exist"):
        _tokens(client, "a")
    assert {m.id for m in client.models.list().data} == {"tiny-llama", "b"}
    r = _unload(url, "a")
    assert r.status_code == 404 and "unknown LoRA adapter 'a'" in r.json()["error"]["message"]
    # the name is free again, for other weights
    assert _load(url, "a", adapters["c"]).status_code == 200
    assert _tokens(client, "a") == oracle.greedy("c", PROMPT, N)
    for name in ("a", "b"):
        assert _unload(url, name).status_code == 200


def test_unload_while_a_stream_runs_with_it(url, client, paths, oracle):
    _, adapters = paths
    assert _load(url, "s", adapters["b"]).status_code == 200
    n = 200  # long enough to be running still when the unload arrives
    first, got = threading.Event(), {}

    def run():
        ids = []
        stream = client.completions.create(model="s", prompt=PROMPT, max_tokens=n, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
                first.set()
        got["ids"] = ids

    t = threading.Thread(target=run)
    t.start()
    assert first.wait(30)
    r = _unload(url, "s")
    t.join(60)
    assert r.status_code == 200 and "1 request(s) accepted before (running or queued) finish with it first" in r.text
    assert got["ids"] == oracle.greedy("b", PROMPT, n)
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "s")


def test_bad_bodies_and_folders_get_4xx(url, paths, tmp_path):
    _, adapters = paths
    cases = [
        (httpx.post(f"{url}/v1/load_lora_adapter", content=b"{not json"), 400, "not valid JSON"),
        (httpx.post(f"{url}/v1/load_lora_adapter", json=["a"]), 400, "must be a JSON object"),
        (httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path must be a non-empty"),
        (httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": 3, "lora_path": "p"}), 400,
         "lora_name must be a non-empty string, got 3"),
        (_load(url, "tiny-llama", adapters["a"]), 400, "is the base model's id"),
        (_load(url, str(ensure_builtin("tiny-llama")), adapters["a"]), 400, "is the base model's id"),
        (_load(url, "gone", tmp_path / "nowhere"), 400, "nowhere"),
        (httpx.post(f"{url}/v1/unload_lora_adapter", json={}), 400, "lora_name must be a non-empty string"),
        (_unload(url, "never"), 404, "unknown LoRA adapter 'never'"),
    ]
    for r, status, words in cases:
        assert r.status_code == status and words in r.json()["error"]["message"], (r.status_code, r.text)
    assert _load(url, "d", adapters["a"]).status_code == 200
    r = _load(url, "d", adapters["b"])
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "lora_name"
    assert _unload(url, "d").status_code == 200
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_off_without_the_flag_and_guarded_by_the_api_key(engine, paths):
    _, adapters = paths
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        for r in (_load(base, "a", adapters["a"]), _unload(base, "a")):
            assert r.status_code == 404 and "--allow-runtime-lora" in r.json()["error"]["message"]
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama", api_key="k", runtime_lora=True)) as base:
        assert _load(base, "a", adapters["a"]).status_code == 401
        assert _unload(base, "a").status_code == 401
        auth = {"headers": {"Authorization": "Bearer k"}}
        assert _load(base, "a", adapters["a"], **auth).status_code == 200
        assert _unload(base, "a", **auth).status_code == 200


def test_a_server_without_adapter_slots_says_how_to_get_them(paths):
    _, adapters = paths
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama", runtime_lora=True)) as base:
        r = _load(base, "a", adapters["a"])
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_cli_flag_from_the_environment(paths, oracle):
    """`infer serve` with INFER_ALLOW_RUNTIME_LORA=1 (the flag's variable): slots without any --lora, routes on."""
    import signal
    _, adapters = paths
    with serve_process("--max-model-len", "256", "--max-lora-rank", "8", env={"INFER_ALLOW_RUNTIME_LORA": "1"}) \
            as (proc, base, names):
        assert names == "none (more can be loaded)"
        assert _load(base, "a", adapters["a"]).status_code == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        assert _tokens(client, "a") == oracle.greedy("a", PROMPT, N)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
