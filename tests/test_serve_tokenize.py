"""vLLM's utility routes on `infer serve`: POST /tokenize (a prompt as `tokenizer(prompt, add_special_tokens=...)`
gives it; chat messages as the ids /v1/chat/completions itself feeds the engine, which are transformers'
`apply_chat_template(..., tokenize=True)`), POST /detokenize (`tokenizer.decode`), GET /version; the base or an
adapter as model, the 404 of the other routes for another; every malformed field a 400 naming it; --api-key."""

from __future__ import annotations

import json
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from transformers import AutoTokenizer  # noqa: E402

import infer  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402

from helpers import tiny_llama_with_template  # noqa: E402

MAX_LEN = 256
# the built-in model's template, plus the tools and a template variable (chat_template_kwargs) in a system turn
TEMPLATE = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
            "{% endif %}{% if terse is defined and terse %}<|im_start|>system\nbe terse<|im_end|>\n{% endif %}"
            "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You help."}, {"role": "user", "content": "What is 2 + 2? Say it ünïcødé."}]
PROMPT = "Hello world, tokenize me: 42 ünïcødé!"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny_llama_with_template(tmp_path_factory.mktemp("tok") / "tiny-tok", TEMPLATE)
    # a BOS (the built-in tokenizer has none), so that add_special_tokens changes a prompt's ids
    spec = json.loads((path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    spec["post_processor"]["single"].insert(0, bos)
    spec["post_processor"]["pair"].insert(0, bos)
    spec["post_processor"]["special_tokens"] = {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                  "tokens": ["<|endoftext|>"]}}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))
    return str(path)


@pytest.fixture(scope="module")
def tok(model):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    from lora_helpers import hf_float, save_adapter
    return save_adapter(hf_float(model), tmp_path_factory.mktemp("lora") / "pirate", seed=3, r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def engine(model, adapter):
    return LLMEngine(EngineConfig(model, max_model_len=MAX_LEN, max_lora_rank=8, loras={"pirate": str(adapter)}))


@pytest.fixture(scope="module")
def server(engine):
    return Server(AsyncEngine(engine), "tiny-tok")


@pytest.fixture(scope="module")
def url(server):
    with serve_in_thread(server) as base:
        yield base


def _post(url, path, body, **kw):
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kw)


def _tokenize(url, **body) -> dict:
    r = _post(url, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()


def _hf_chat(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def _chat_prompt_ids(url, **body) -> list[int]:
    """The prompt ids /v1/chat/completions gave the engine for `body`."""
    r = _post(url, "/v1/chat/completions", {"max_tokens": 1, "temperature": 0, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["prompt_token_ids"]


# ---------------------------------------------------------------------------------------------- the prompt form
def test_prompt_is_the_tokenizer_with_special_tokens_by_default(url, tok):
    want = tok(PROMPT)["input_ids"]
    assert want[0] == tok.bos_token_id  # the default adds them
    out = _tokenize(url, prompt=PROMPT)
    assert out == {"count": len(want), "max_model_len": MAX_LEN, "tokens": want, "token_strs": None}
    assert _tokenize(url, model="tiny-tok", prompt=PROMPT, add_special_tokens=True)["tokens"] == want


def test_prompt_without_special_tokens_and_with_token_strs(url, tok):
    want = tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert want != tok(PROMPT)["input_ids"]
    out = _tokenize(url, prompt=PROMPT, add_special_tokens=False, return_token_strs=True)
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["token_strs"] == tok.convert_ids_to_tokens(want)


def test_a_prompt_longer_than_the_context_is_counted_not_refused(url, tok):
    text = "word " * (MAX_LEN * 2)  # as vLLM: count against max_model_len tells whether it fits
    out = _tokenize(url, prompt=text)
    assert out["tokens"] == tok(text)["input_ids"] and out["count"] > MAX_LEN


# ---------------------------------------------------------------------------------------------- the chat form
def test_chat_is_the_chat_endpoint_prompt_and_transformers(url, tok):
    want = _hf_chat(tok, MESSAGES, add_generation_prompt=True)
    out = _tokenize(url, messages=MESSAGES, return_token_strs=True)
    assert out["tokens"] == want == _chat_prompt_ids(url, messages=MESSAGES)
    assert out["count"] == len(want) and out["max_model_len"] == MAX_LEN
    assert out["token_strs"] == tok.convert_ids_to_tokens(want)


def test_chat_without_generation_prompt(url, tok):
    want = _hf_chat(tok, MESSAGES, add_generation_prompt=False)
    assert want != _hf_chat(tok, MESSAGES, add_generation_prompt=True)
    assert _tokenize(url, messages=MESSAGES, add_generation_prompt=False)["tokens"] == want \
        == _chat_prompt_ids(url, messages=MESSAGES, add_generation_prompt=False)


def test_chat_continue_final_message_kwargs_and_tools(url, tok):
    prefill = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    want = _hf_chat(tok, prefill, add_generation_prompt=False, continue_final_message=True)
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    assert _tokenize(url, **body)["tokens"] == want == _chat_prompt_ids(url, **body)
    want = _hf_chat(tok, MESSAGES, add_generation_prompt=True, tools=TOOLS, terse=True)
    assert want != _hf_chat(tok, MESSAGES, add_generation_prompt=True)
    body = {"messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"terse": True}}
    assert _tokenize(url, **body)["tokens"] == want == _chat_prompt_ids(url, **body, tool_choice="none")


def test_chat_content_parts_as_the_chat_endpoint_joins_them(url):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert _tokenize(url, messages=parts)["tokens"] == _chat_prompt_ids(url, messages=parts)


def test_tokenization_runs_on_the_parse_threads(url, server, monkeypatch):
    """Not on the event loop: the chat endpoint's parse pool tokenizes, as it renders chat requests."""
    seen = []
    real = server.parser.tokenizer

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *a, **kw):
            seen.append(threading.current_thread().name)
            return real(*a, **kw)

        def apply_chat_template(self, *a, **kw):
            seen.append(threading.current_thread().name)
            return real.apply_chat_template(*a, **kw)

        def decode(self, *a, **kw):
            seen.append(threading.current_thread().name)
            return real.decode(*a, **kw)

    monkeypatch.setattr(server.parser, "tokenizer", Spy())
    _tokenize(url, prompt="x")
    _tokenize(url, messages=MESSAGES)
    assert _post(url, "/detokenize", {"tokens": [5, 6]}).status_code == 200
    assert len(seen) == 3 and all(name.startswith("infer-parse") for name in seen), seen


# ---------------------------------------------------------------------------------------------- detokenize
def test_detokenize_roundtrip(url, tok):
    ids = tok(PROMPT)["input_ids"]
    r = _post(url, "/detokenize", {"model": "tiny-tok", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(ids)}  # special tokens kept, as vLLM decodes
    assert r.json()["prompt"].endswith(PROMPT) and tok.bos_token in r.json()["prompt"]
    chat = _tokenize(url, messages=MESSAGES)["tokens"]
    assert _post(url, "/detokenize", {"tokens": chat}).json()["prompt"] == tok.decode(chat)
    assert _post(url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


# ---------------------------------------------------------------------------------------------- models, version
def test_an_adapter_shares_the_tokenizer_and_another_model_is_404(url, tok):
    assert _tokenize(url, model="pirate", prompt=PROMPT)["tokens"] == tok(PROMPT)["input_ids"]
    assert _post(url, "/detokenize", {"model": "pirate", "tokens": [5]}).json() == {"prompt": tok.decode([5])}
    for path, body in (("/tokenize", {"model": "nope", "prompt": "x"}),
                       ("/tokenize", {"model": "nope", "messages": MESSAGES}),
                       ("/detokenize", {"model": "nope", "tokens": [1]})):
        r = _post(url, path, body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == "model_not_found" and "tiny-tok" in err["message"]


def test_version(url):
    r = httpx.get(f"{url}/version")
    assert r.status_code == 200 and r.json() == {"version": infer.__version__}


# ---------------------------------------------------------------------------------------------- bad requests
BAD = [
    ("/tokenize", b"{not json", None),
    ("/tokenize", b"[1, 2]", None),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": 3}, "model"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "f"}]}, "tools"),
    ("/tokenize", {"messages": MESSAGES, "tools": {}}, "tools"),
    ("/tokenize", {"messages": MESSAGES, "return_token_strs": "true"}, "return_token_strs"),
    ("/detokenize", b"{not json", None),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2.0]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [512]}, "tokens"),  # the tokenizer's ids are 0..511
    ("/detokenize", {"tokens": [2 ** 70]}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": ["tiny-tok"]}, "model"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_fields_are_400_naming_them(url, path, body, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}{path}", headers={"content-type": "application/json"}, timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_the_vocabulary_bound_is_the_tokenizers(url, tok):
    top = max(tok.get_vocab().values())
    assert _post(url, "/detokenize", {"tokens": [top]}).json() == {"prompt": tok.decode([top])}


def test_get_is_405(url):
    assert httpx.get(f"{url}/tokenize").status_code == 405
    assert httpx.post(f"{url}/version").status_code == 405


# ---------------------------------------------------------------------------------------------- auth
def test_api_key_guards_them_as_metrics_not_health(engine):
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-tok", api_key="s3cret")) as base:
        for method, path, body in (("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/version", None)):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = httpx.request(method, f"{base}{path}", json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            r = httpx.request(method, f"{base}{path}", json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200, r.text
        # a bad body without the key is still a 401: nothing is read before the key is checked
        assert httpx.post(f"{base}/tokenize", content=b"{not json").status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200


# ---------------------------------------------------------------------------------------------- data parallel
def test_the_data_parallel_server_has_them(model, tok):
    """`serve --data-parallel` builds its app with the same create_app: the routes answer from the driver's tokenizer."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'infer[ray]')")
    from infer.parallel.serve import build_server
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2 ** 20, logging_level="ERROR")
    try:
        srv, _ = build_server(ray, EngineConfig(model, max_model_len=MAX_LEN, max_num_seqs=2), 1, "tiny-tok",
                              api_key=None, max_queue=8, shutdown_timeout=5)
        with serve_in_thread(srv) as base:
            want = _hf_chat(tok, MESSAGES, add_generation_prompt=True)
            assert _tokenize(base, messages=MESSAGES)["tokens"] == want == _chat_prompt_ids(base, messages=MESSAGES)
            ids = tok(PROMPT)["input_ids"]
            assert _tokenize(base, prompt=PROMPT) == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                                                      "token_strs": None}
            assert _post(base, "/detokenize", {"tokens": want}).json() == {"prompt": tok.decode(want)}
            assert httpx.get(f"{base}/version").json() == {"version": infer.__version__}
    finally:
        ray.shutdown()
