"""Classification gaps closed as vLLM's pooling runner behaves: `infer run` on a classifier classifies its lines
(the probabilities /classify answers, equal to transformers'), /classify's chat form (messages), /score's spellings
of its two texts (data_1/data_2, queries/documents, queries/items), rerank's documents given as token ids answered as
text, use_activation refused on an embedding model, and a cross-encoder's refusals naming the text at fault."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM, PoolingParams
from infer.errors import RequestError

from test_probes_session60_classify import (DOCS, _pair_scores, _post, _serve, check_close, hf_logits,  # noqa: F401
                                            llama3, qwen_ce, served_classifier, served_cross_encoder)

CHAT = [{"role": "system", "content": "rate it"}, {"role": "user", "content": "great product"}]
SHORT = [{"role": "user", "content": "ok"}]  # (the served classifier's context is 32 tokens)


def test_infer_run_classifies_lines_as_transformers(tmp_path, llama3):
    """A line of infer's format on a classifier classifies its prompt (prompt, input, prompt_token_ids, messages
    rendered without a generation prompt): label, probs (transformers' softmax; use_activation false: its
    logits), num_classes; a generation field or several inputs in one line is refused; the summary says
    classified. A /classify batch line is told to write its inputs as such lines."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from helpers import infer_run_records
    from infer.cli.main import app
    path, hf = llama3
    tok = AutoTokenizer.from_pretrained(path)
    chat_ids = list(tok.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=True, return_dict=True)
                    ["input_ids"])
    lines = [{"id": "p", "prompt": "hello world"}, {"id": "i", "input": [5, 9, 17, 3]},
             {"id": "t", "prompt_token_ids": [7, 8, 9], "use_activation": False}, {"id": "m", "messages": CHAT},
             {"id": "g", "prompt": "hi", "temperature": 0.5}, {"id": "two", "input": ["a", "b"]},
             {"custom_id": "c", "url": "/classify", "body": {"input": "hi"}}]
    recs, _ = infer_run_records(tmp_path, lines, "--block-size", "4", model=str(path))
    want = {"p": torch.softmax(hf_logits(hf, tok("hello world")["input_ids"]), -1),
            "i": torch.softmax(hf_logits(hf, [5, 9, 17, 3]), -1), "t": hf_logits(hf, [7, 8, 9]),
            "m": torch.softmax(hf_logits(hf, chat_ids), -1)}
    check_close([torch.tensor(recs[k]["probs"]) for k in want], list(want.values()))
    for key, w in want.items():
        assert recs[key]["label"] == ["negative", "neutral", "positive"][int(w.argmax())], recs[key]
        assert recs[key]["num_classes"] == 3 and recs[key]["error"] is None
    assert recs["m"]["usage"]["prompt_tokens"] == len(chat_ids)
    assert "generation field(s) ['temperature']: this model is a classifier" in recs["g"]["error"], recs["g"]
    assert "input holds 2 inputs: a line classifies one prompt" in recs["two"]["error"], recs["two"]
    assert 'infer\'s own format, {"prompt": ...}, which infer run classifies' in recs["c"]["error"], recs["c"]
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"prompt": "a b c"}) + "\n")
    res = CliRunner().invoke(app, ["run", str(path), str(src), "-o", str(tmp_path / "one.out"), "--block-size", "4"])
    assert res.exit_code == 0 and "1 ok, 0 failed" in res.output and "prompt tokens classified" in res.output, \
        res.output


def test_classify_chat_form_equals_transformers(served_classifier, llama3):
    """POST /classify with messages (vLLM's ClassificationChatRequest): the chat template's rendering without a
    generation prompt (add_generation_prompt true adds it), classified as transformers; input and messages
    together are refused."""
    from transformers import AutoTokenizer
    path, hf = llama3
    tok = AutoTokenizer.from_pretrained(path)
    for gen in (False, True):
        ids = list(tok.apply_chat_template(SHORT, add_generation_prompt=gen, tokenize=True, return_dict=True)
                   ["input_ids"])
        status, body = _post(served_classifier, "/classify", {"messages": SHORT, **({"add_generation_prompt": True}
                                                                                    if gen else {})})
        assert status == 200, body
        check_close([torch.tensor(body["data"][0]["probs"])], [torch.softmax(hf_logits(hf, ids), -1)])
        assert body["usage"]["prompt_tokens"] == len(ids)
    status, body = _post(served_classifier, "/classify", {"messages": SHORT, "input": "hi"})
    assert status == 400 and "send either input or messages" in body["error"]["message"], body


def test_score_takes_vllms_spellings_of_its_texts(served_cross_encoder, qwen_ce):
    """/score reads text_1/text_2, data_1/data_2, queries/documents and queries/items alike (vLLM's ScoreRequest),
    each scored as transformers' pair encoding; two pairs at once, or half of one, are refused naming the field."""
    from transformers import AutoTokenizer
    path, hf = qwen_ce
    want = torch.tensor(_pair_scores(hf, AutoTokenizer.from_pretrained(path), "where is the cat", DOCS))
    for one, two in (("data_1", "data_2"), ("queries", "documents"), ("queries", "items")):
        status, body = _post(served_cross_encoder, "/score", {one: "where is the cat", two: DOCS})
        assert status == 200, body
        torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), want, atol=1e-5, rtol=1e-4)
    status, body = _post(served_cross_encoder, "/score", {"data_1": ["a", "b"], "data_2": ["c", "d", "e"]})
    assert status == 400 and "data_1 has 2 texts and data_2 3" in body["error"]["message"], body
    status, body = _post(served_cross_encoder, "/score", {"queries": "q", "documents": ["d"], "items": ["e"]})
    assert status == 400 and body["error"]["param"] == "items", body
    assert "gives queries/documents and queries/items" in body["error"]["message"], body
    status, body = _post(served_cross_encoder, "/score", {"queries": "q"})
    assert status == 400 and body["error"]["param"] == "documents", body
    assert body["error"]["message"].startswith("documents is required beside queries"), body


def test_cross_encoder_names_the_text_at_fault_and_scores_empty_texts(served_cross_encoder, qwen_ce):
    """A token id outside the vocabulary names its text (text_2, documents[1]), a query that leaves no room for any
    document names the query (not documents[0]); an empty document is scored as vLLM scores it (the tokenizer's
    pair of the query and ""), as transformers; rerank's token-id documents answer their decoded text."""
    from transformers import AutoTokenizer
    path, hf = qwen_ce
    tok = AutoTokenizer.from_pretrained(path)
    vocab = hf.config.vocab_size
    for route, body, param in (("/score", {"text_1": "a", "text_2": [1, vocab]}, "text_2"),
                               ("/rerank", {"query": "a", "documents": [[1, 2], [3, vocab + 5]]}, "documents"),
                               ("/rerank", {"query": "w " * 40, "documents": ["a", "b"]}, "query")):
        status, reply = _post(served_cross_encoder, route, body)
        assert status == 400 and reply["error"]["param"] == param, reply
    assert "documents[1]: token id" in _post(served_cross_encoder, "/rerank", {
        "query": "a", "documents": [[1, 2], [3, vocab + 5]]})[1]["error"]["message"]
    status, body = _post(served_cross_encoder, "/score", {"text_1": "where is the cat", "text_2": ["", "a dog"]})
    assert status == 200, body
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]),
                               torch.tensor(_pair_scores(hf, tok, "where is the cat", ["", "a dog"])),
                               atol=1e-5, rtol=1e-4)
    ids = tok("a dog", add_special_tokens=False)["input_ids"]
    status, body = _post(served_cross_encoder, "/rerank", {"query": "where is the cat", "documents": [ids, "x"]})
    assert status == 200, body
    assert {r["index"]: r["document"]["text"] for r in body["results"]} == {0: "a dog", 1: "x"}, body
    with LLM(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=2) as llm:  # (LLM.score alike)
        got = [o.outputs.score for o in llm.score("where is the cat", ["", "a dog"])]
        with pytest.raises(RequestError, match=r"data_2: token id \d+ is outside the vocabulary"):
            llm.score("a", [1, vocab])
    want = _pair_scores(hf, tok, "where is the cat", ["", "a dog"])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


def test_embedding_model_refuses_use_activation():
    """An embedding model scores by cosine: use_activation (a classifier's) is refused as vLLM's embed task refuses
    it, on /score (naming the field) and by LLM.score; an empty text, which has nothing to embed, is refused."""
    gen = _serve("tiny-qwen3", runner="pooling")
    base = next(gen)
    try:
        refused = _post(base, "/score", {"text_1": "a", "text_2": "b", "use_activation": True})
        empty = _post(base, "/score", {"text_1": "a", "text_2": ["b", ""]})
        fine = _post(base, "/score", {"text_1": "a", "text_2": "b"})
    finally:
        gen.close()
    assert refused[0] == 400 and refused[1]["error"]["param"] == "use_activation", refused
    assert "use_activation is a classifier's field" in refused[1]["error"]["message"], refused
    assert empty[0] == 400 and "text_2[1] is an empty string" in empty[1]["error"]["message"], empty
    assert fine[0] == 200, fine
    with LLM("tiny-qwen3", runner="pooling", block_size=4, max_num_batched_tokens=8, max_num_seqs=2) as llm:
        with pytest.raises(RequestError, match="use_activation is a classifier's field"):
            llm.score("a", "b", pooling_params=PoolingParams(use_activation=False))
