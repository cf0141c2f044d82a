"""`infer serve --data-parallel 2` whose replicas die: killing one fails no request that had not started on it,
and when the last one dies under a stream the stream ends with an error and new requests are a 503. A module of its
own (its own Ray runtime and server): under `--dist worksteal` the tests of one module may run in another order, and
the tests of test_ray_serve.py found the replicas this one killed."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'infer[ray]')")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from infer.serve.app import serve_in_thread  # noqa: E402

from helpers import kill_actor  # noqa: E402
from test_ray_serve import PROMPTS, _all, _build_server, _complete, one_engine_tokens  # noqa: E402


@pytest.fixture(scope="module")
def want():
    return one_engine_tokens()


@pytest.fixture(scope="module")
def doomed():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2 ** 20, logging_level="ERROR")
    try:
        srv = _build_server()
        with serve_in_thread(srv) as base:
            yield srv, base
    finally:
        ray.shutdown()


def test_killed_replicas_fail_no_request_that_had_not_started_and_end_a_running_stream_with_an_error(doomed, want):
    """Replica 0 killed: requests sent to it that had not started run again on replica 1. Then replica 1, the last
    one, dies under a stream: the stream ends with an error event (never hangs), and with no replica left a new
    request fails at once."""
    server, url = doomed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    kill_actor(ray, server.aengine.replicas[0].handle)
    assert _all(client) == want * 2  # requests sent to the dead replica ran again on the other
    health = httpx.get(f"{url}/health").json()["engine"]
    assert [r["alive"] for r in health["replicas"]] == [False, True] and health["num_replicas_alive"] == 1
    assert 'infer:replica_up{replica="0"} 0.0' in httpx.get(f"{url}/metrics").text

    stream = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    ray.kill(server.aengine.replicas[1].handle, no_restart=True)
    with pytest.raises(openai.APIError, match="replica 1 stopped"):
        list(chunks)
    with pytest.raises(openai.APIError, match="no engine replica is left"):
        _complete(client, PROMPTS[1])
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine_replica" and "retry-after" in r.headers
    health = httpx.get(f"{url}/health")  # a load balancer's probe sees the server cannot answer (it said ok)
    assert health.status_code == 503 and health.json()["engine"]["num_replicas_alive"] == 0
    assert all(r["num_running"] == 0 for r in health.json()["engine"]["replicas"])  # dead: frozen figures dropped
