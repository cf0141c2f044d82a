"""`infer serve --data-parallel 2` on a local Ray runtime with CPU replicas: the openai client gets the tokens one
engine gives, streams, /health and /metrics show each replica, adapters load and unload on every replica (killed
replicas: test_ray_serve_kill.py)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'infer[ray]')")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.sampling_params import SamplingParams  # noqa: E402
from infer.serve.app import serve_in_thread  # noqa: E402

MAX_LEN = 256
PROMPTS = [[5, 17, 99, 230, 41, 7], [8, 9, 10], [300, 301, 302, 303, 304, 305, 306, 307], [42] * 5]


@pytest.fixture(scope="module")
def runtime():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2 ** 20, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


def _build_server():
    from infer.parallel.serve import build_server
    cfg = EngineConfig("tiny-llama", max_model_len=MAX_LEN, max_num_seqs=4, enable_lora=True, max_lora_rank=8)
    srv, _ = build_server(ray, cfg, 2, "tiny-llama", api_key=None, max_queue=64, shutdown_timeout=5,
                          runtime_lora=True, max_restarts=0)  # (a dead replica stays dead: no test misses one)
    return srv


@pytest.fixture(scope="module")
def server(runtime):
    """The server of every test here: each leaves both replicas running, so they pass in any order (under
    `--dist worksteal` a module's tests may run in another order, or on two workers). The test that kills replicas
    has a server of its own (test_ray_serve_kill.py)."""
    return _build_server()


@pytest.fixture(scope="module")
def url(server):
    with serve_in_thread(server) as base:
        yield base


def one_engine_tokens() -> list[list[int]]:
    """One engine's greedy tokens for every prompt: the oracle."""
    from infer.engine.llm import LLM
    outs = LLM("tiny-llama", max_model_len=MAX_LEN).generate(PROMPTS, SamplingParams(max_new_tokens=10,
                                                                                      ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def want():
    return one_engine_tokens()


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from pathlib import Path

    from infer.models.tiny import ensure_builtin
    from lora_helpers import THREE, hf_float, save_adapter
    hf = hf_float(Path(ensure_builtin("tiny-llama")))
    return save_adapter(hf, tmp_path_factory.mktemp("ray-lora") / "r", seed=5, **THREE["a"])


@pytest.fixture(scope="module")
def want_lora(adapter):
    """One engine's greedy tokens with the adapter (test_lora_engine checks those against peft)."""
    from infer.engine.llm import LLM
    llm = LLM("tiny-llama", max_model_len=MAX_LEN, loras={"r": str(adapter)}, max_lora_rank=8)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=10, ignore_eos=True), lora="r")
    long = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=150, ignore_eos=True), lora="r")
    return [o.token_ids for o in outs], long[0].token_ids


def _complete(client, prompt, model="tiny-llama"):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].model_extra["token_ids"]


def _all(client) -> list:
    with cf.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        return list(pool.map(lambda p: _complete(client, p), PROMPTS * 2))


def test_same_tokens_as_one_engine_on_both_replicas(client, url, want):
    assert _all(client) == want * 2
    replicas = httpx.get(f"{url}/health").json()["engine"]["replicas"]
    assert [r["alive"] for r in replicas] == [True, True]
    assert all(r["num_steps"] > 0 for r in replicas), "both replicas should have run requests"


def test_streaming(client, want):
    chunks = list(client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert len(chunks) > 2 and text == full.choices[0].text


def test_metrics_per_replica(url):
    body = httpx.get(f"{url}/metrics").text
    assert 'infer:replica_up{replica="0"} 1.0' in body and 'infer:replica_up{replica="1"} 1.0' in body
    assert "infer:replica_num_requests_running" in body and "infer:num_requests_running" in body


def test_reset_prefix_cache_forgets_the_prompts_of_every_replica(url):
    """POST /reset_prefix_cache (vLLM's) reaches every replica: a prompt sent before, whichever replica takes it
    now, finds nothing cached."""
    prompt = list(range(5, 53))  # three whole blocks of 16

    def complete():
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text

    def hits():
        return httpx.get(f"{url}/health", timeout=30).json()["engine"]["prefix_cache_hits"]
    for _ in range(4):  # on both replicas, whichever the router picks
        complete()
    warm = hits()
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=60).status_code == 200
    complete()
    assert hits() == warm


def test_adapters_load_and_unload_on_every_replica(client, url, server, adapter, want_lora):
    short, long = want_lora
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "r", "lora_path": str(adapter)}, timeout=60)
    assert r.status_code == 200, r.text
    steps = [r["num_steps"] for r in httpx.get(f"{url}/health").json()["engine"]["replicas"]]
    with cf.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        assert list(pool.map(lambda p: _complete(client, p, "r"), PROMPTS * 2)) == short * 2
    after = [r["num_steps"] for r in httpx.get(f"{url}/health").json()["engine"]["replicas"]]
    assert all(b > a for a, b in zip(steps, after)), "both replicas should have run the adapter's requests"
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nowhere/at/all"}, timeout=60)
    assert r.status_code == 400 and "replica 0" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "lora_path"  # the folder is the problem
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "r", "lora_path": str(adapter)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text  # the name is taken
    assert {m.id for m in client.models.list().data} == {"tiny-llama", "r"}

    got, first = {}, cf.Future()

    def stream():  # runs on while the adapter is unloaded
        ids = []
        for chunk in client.completions.create(model="r", prompt=PROMPTS[0], max_tokens=150, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True,
                                                                        "return_token_ids": True}):
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
                if not first.done():
                    first.set_result(True)
        got["ids"] = ids

    with cf.ThreadPoolExecutor(1) as pool:
        job = pool.submit(stream)
        first.result(timeout=60)
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "r"}, timeout=60)
        job.result(timeout=120)
    assert r.status_code == 200 and got["ids"] == long
    with pytest.raises(openai.NotFoundError):
        _complete(client, PROMPTS[0], "r")
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "r"}).status_code == 404
