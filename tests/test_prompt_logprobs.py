"""prompt_logprobs (vLLM's SamplingParams field): each prompt token's logprob, rank and top-k under the model given the
tokens before it, against transformers' forward pass on the same weights: whole prompts, prompts split over
several steps (chunked prefill), with overlapped steps, beside requests without them, with a cached prefix (which
such a request computes anyway) and after a preemption (which must not record a position twice)."""

from __future__ import annotations

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin

from helpers import hf_model, random_prompts


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


def _hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)  # row p: the distribution of token p + 1


def _check(path, prompt, records, k: int) -> None:
    want = _hf_prompt_logprobs(path, prompt)
    assert records[0] is None and len(records) == len(prompt)
    for t in range(1, len(prompt)):
        rec, row = records[t], want[t - 1]
        assert rec["token_id"] == prompt[t]
        assert rec["logprob"] == pytest.approx(row[prompt[t]].item(), abs=1e-4)
        assert rec["rank"] == int((row >= row[prompt[t]]).sum())  # vLLM: the tokens at least as likely
        if k:
            top = row.topk(k)
            assert [e["token_id"] for e in rec["top_logprobs"]] == top.indices.tolist()
            assert [e["logprob"] for e in rec["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        else:
            assert "top_logprobs" not in rec


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_equal_transformers_whole_and_chunked(path, overlap):
    prompts = random_prompts(512, (9, 23, 5), seed=1)
    # a step budget of 8 tokens splits the 23-token prompt over several steps, beside the others
    with LLM(path, block_size=4, max_num_batched_tokens=8, max_num_seqs=4, overlap=overlap) as llm:
        params = [SamplingParams(max_new_tokens=3, prompt_logprobs=3, ignore_eos=True),
                  SamplingParams(max_new_tokens=3, prompt_logprobs=0, ignore_eos=True),
                  SamplingParams(max_new_tokens=3, ignore_eos=True)]
        outs = llm.generate(prompts, params)
    _check(path, prompts[0], outs[0].prompt_logprobs, 3)
    _check(path, prompts[1], outs[1].prompt_logprobs, 0)
    assert outs[2].prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(path):
    prompt = random_prompts(512, (17,), seed=2)[0]
    with LLM(path, block_size=4) as llm:
        llm.generate([prompt], SamplingParams(max_new_tokens=2))  # its blocks are now cached
        again = llm.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=1))[0]
        plain = llm.generate([prompt], SamplingParams(max_new_tokens=2))[0]
    assert again.num_cached_tokens == 0 and plain.num_cached_tokens > 0
    _check(path, prompt, again.prompt_logprobs, 1)


def test_a_preempted_request_records_each_position_once(path):
    """A KV cache too small for both requests: one is preempted and recomputed; its prompt logprobs are still one
    record per prompt token, equal to transformers'."""
    prompts = random_prompts(512, (14, 13), seed=3)
    with LLM(path, block_size=4, num_kv_blocks=10, max_model_len=40, max_num_seqs=2) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=20, prompt_logprobs=2, ignore_eos=True))
        assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(path, prompt, out.prompt_logprobs, 2)


def test_prompt_logprobs_range_is_checked(path):
    """As vLLM: SamplingParams takes any count (or -1); the engine caps it at its max_logprobs (20 by default)."""
    with pytest.raises(RequestError, match="prompt_logprobs must be at least 0, or -1"):
        SamplingParams(prompt_logprobs=-2)
    with LLM(path, block_size=4, max_model_len=40) as llm:
        with pytest.raises(RequestError, match="prompt_logprobs must be in 0..20, got 21"):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=1, prompt_logprobs=21))


def test_the_server_returns_vllms_prompt_logprobs(path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    prompt = random_prompts(512, (8,), seed=4)[0]
    want = _hf_prompt_logprobs(path, prompt)
    engine = LLMEngine(EngineConfig(path, max_model_len=64, block_size=4))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
        entries = r.json()["choices"][0]["prompt_logprobs"]
        chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 2, "prompt_logprobs": 0}, timeout=60)
        streamed = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "stream": True,
                                                              "prompt_logprobs": 1}, timeout=60)
    assert entries[0] is None and len(entries) == len(prompt)
    for t in range(1, len(prompt)):
        mine = entries[t][str(prompt[t])]
        assert mine["logprob"] == pytest.approx(want[t - 1][prompt[t]].item(), abs=1e-4)
        assert mine["rank"] == int((want[t - 1] >= want[t - 1][prompt[t]]).sum())
        top = want[t - 1].topk(2).indices.tolist()
        assert {str(i) for i in top} <= set(entries[t]) and entries[t][str(top[0])]["rank"] == 1
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    assert len(chat.json()["prompt_logprobs"]) == chat.json()["usage"]["prompt_tokens"]
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_infer_run_writes_prompt_logprobs(path, tmp_path):
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    prompt = random_prompts(512, (6,), seed=5)[0]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": prompt, "max_new_tokens": 2, "prompt_logprobs": 1})
                   + "\n" + json.dumps({"id": "b", "prompt_token_ids": prompt, "max_new_tokens": 2}) + "\n")
    res = CliRunner().invoke(app, ["run", path, str(src), "-o", str(dst), "-q"])
    assert res.exit_code == 0, res.output
    recs = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert "prompt_logprobs" not in recs["b"]
    lp = recs["a"]["prompt_logprobs"]
    assert lp[0] is None and [r["token_id"] for r in lp[1:]] == prompt[1:] and "token" in lp[1]
    want = _hf_prompt_logprobs(path, prompt)
    assert lp[3]["logprob"] == pytest.approx(want[2][prompt[3]].item(), abs=1e-4)


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_reads_them(path):
    """OpenAI's legacy `echo` on /v1/completions, as lm-evaluation-harness scores a continuation (`echo: true,
    logprobs: 1`, `max_tokens` 0 or 1): the text starts with the prompt, and logprobs.token_logprobs has one entry
    per prompt token (null first) equal to transformers', then the reply's."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(path, max_model_len=64, block_size=4))
    text = "hello world, this is"
    ids = engine.tokenizer(text)["input_ids"]
    want = _hf_prompt_logprobs(path, ids)
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        def post(**body):
            return httpx.post(f"{base}/v1/completions", json={"prompt": text, "temperature": 0, **body}, timeout=60)
        zero, one = post(echo=True, logprobs=1, max_tokens=0), post(echo=True, logprobs=1, max_tokens=1)
        plain, ids_echo = post(max_tokens=1), post(echo=True, max_tokens=2, prompt=ids)
        refused = [post(max_tokens=0)]  # echo in a stream: test_probes_session40_streaming.py
        chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "echo": True, "max_tokens": 1}, timeout=60)
    for r in (zero, one, plain, ids_echo):
        assert r.status_code == 200, r.text
    z, o = zero.json()["choices"][0], one.json()["choices"][0]
    reply = plain.json()["choices"][0]["text"]
    assert z["text"] == text and o["text"] == text + reply and z["finish_reason"] == "length"
    assert zero.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = o["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(want[t - 1][ids[t]].item(), abs=1e-4)
        assert len(lp["top_logprobs"][t]) <= 2  # the prompt's token and the most likely one
    assert z["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)] and "prompt_logprobs" not in o
    assert ids_echo.json()["choices"][0]["text"].startswith(engine.tokenizer.decode(ids))
    assert [r.status_code for r in refused] == [400]
    # chat's echo is vLLM's (the last message's text when it has the reply's role: here a user's, so none), not the
    # prompt's: test_probes_session52_openai.py
    assert chat.status_code == 200 and "logprobs" not in chat.json()["choices"][0]["message"], chat.text
