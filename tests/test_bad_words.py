"""vLLM's `bad_words` against transformers' NoBadWordsLogitsProcessor (`generate(bad_words_ids=...)`) on the same
weights, greedy, token for token; its reading of the words into token ids (alone, and after a space when that is
another first token of the same length); overlapped steps (a word of several tokens needs the last token sampled);
the server and `infer run` lines; and bad input refused with the field named."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import RequestError

from helpers import closing_llm as llm, hf_model, tiny_llama_str as path  # noqa: F401 (fixtures)

PROMPTS = ["hello world", "the cat sat on", "a b c d e", "trains leave at", "why is the sky"]


def _vllm_rule(tok, word: str) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer, written out here as the oracle of the reading."""
    out = [tok.encode(word.lstrip(), add_special_tokens=False)]
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    if spaced[0] != out[-1][0] and len(spaced) == len(out[-1]):
        out.append(spaced)
    return out


def _hf(path, tok, prompt: str, bad: list[list[int]], n: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model(path).generate(ids, max_new_tokens=n, do_sample=False, bad_words_ids=bad, eos_token_id=2,
                                      pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _words(llm, prompt: str) -> list[str]:
    """Words the greedy reply would write: the text of its tokens 2-3, and of its token 5 (two readings each)."""
    reply = llm.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    return [llm.tokenizer.decode(reply[2:4]), llm.tokenizer.decode(reply[5:6])]


def test_the_words_are_read_as_vllm_reads_them(llm):
    for word in ("hello", " world", "the cat", "zz", "é"):
        assert llm.engine.bad_word_ids([word]) == [ids for ids in _vllm_rule(llm.tokenizer, word) if ids]


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_tokens_equal_transformers_no_bad_words(path, llm, overlap):
    tok = llm.tokenizer
    engine = llm if not overlap else LLM(path, block_size=4, overlap=True)
    prompts, params, bads = [], [], []
    for prompt in PROMPTS:
        words = [w for w in _words(llm, prompt) if w.strip()]
        prompts.append(prompt)
        params.append(SamplingParams(max_new_tokens=12, bad_words=words))
        bads.append(engine.engine.bad_word_ids(words))
    prompts.append(PROMPTS[0])  # a request without bad words in the same batch
    params.append(SamplingParams(max_new_tokens=12))
    bads.append(None)
    outs = engine.generate(prompts, params)
    changed = 0
    for prompt, out, bad in zip(prompts, outs, bads):
        want = _hf(path, tok, prompt, bad, 12)
        assert out.token_ids == want[:len(out.token_ids)] and len(out.token_ids) == len(want), prompt
        if bad is not None:
            changed += out.token_ids != _hf(path, tok, prompt, None, 12)
            for ids in bad:  # no bad word anywhere in the reply
                k = len(ids)
                assert all(out.token_ids[i:i + k] != ids for i in range(len(out.token_ids) - k + 1))
    assert changed >= 3  # the words were in the way of the plain replies: the test bans something
    if overlap:
        engine.close()


def test_a_sampled_reply_never_holds_a_bad_word(llm):
    tok = llm.tokenizer
    words = [tok.decode([t]) for t in range(40, 140) if tok.decode([t]).strip()][:60]
    outs = llm.generate(["go"] * 8, [SamplingParams(max_new_tokens=30, temperature=2.0, seed=s, bad_words=words,
                                                    ignore_eos=True) for s in range(8)])
    banned = {ids[-1] for ids in llm.engine.bad_word_ids(words) if len(ids) == 1}
    assert len(banned) >= 40
    for out in outs:
        assert not banned & set(out.token_ids)


@pytest.mark.parametrize("value,message", [([""], "non-empty strings"), ([" "], "non-empty strings"),
                                           ([3], "non-empty strings"), (["x"] * 257, "more than 256"),
                                           ({"x": 1}, "must be a list of strings")])
def test_bad_input_is_refused(value, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(bad_words=value)
    assert SamplingParams(bad_words="x").bad_words == ["x"]


def test_the_server_and_infer_run_take_bad_words(tmp_path, llm):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from typer.testing import CliRunner
    from infer.cli.main import app
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    words = _words(llm, PROMPTS[1])
    want = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=10, bad_words=words))[0]
    engine = LLMEngine(EngineConfig("tiny-llama", block_size=4))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0,
                                                       "bad_words": words, "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "bad_words": "oops"}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": PROMPTS[1], "max_new_tokens": 10, "bad_words": words}) + "\n"
                   + json.dumps({"custom_id": "b", "body": {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0,
                                                            "bad_words": words}}) + "\n")
    CliRunner().invoke(app, ["run", "tiny-llama", str(src), "-o", str(out), "-q"])
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["a"]["token_ids"] == recs["b"]["token_ids"] == want.token_ids
