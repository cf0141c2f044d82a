"""Hostile inputs to this session's classify / score / rerank changes: rerank's documents given as one list of token
ids (a 500), an empty rerank query (refused where /score scores an empty text_1), vLLM's deprecated spellings of
use_activation (softmax, activation: ignored, so probabilities came back where logits were asked), and an `infer run`
chat line's template fields on a classifier (refused as unknown, where /classify reads them)."""

from __future__ import annotations

import torch

from test_probes_session60_classify import (_pair_scores, _post, _serve, check_close, hf_logits,  # noqa: F401
                                            llama3, qwen_ce, served_classifier, served_cross_encoder)

DOCS = ["a dog", "the cat sat on the mat"]
CHAT = [{"role": "user", "content": "great product"}]


def test_rerank_refuses_a_flat_list_of_token_ids(served_cross_encoder):
    """documents [1, 2] was read as one document of token ids and ranked as two: an IndexError, a 500. Now a 400
    naming documents and how to write token-id documents (vLLM's documents is a list of texts)."""
    status, reply = _post(served_cross_encoder, "/rerank", {"query": "q", "documents": [1, 2]})
    assert status == 400 and reply["error"]["param"] == "documents", reply
    assert "documents is a list of token ids, not a list of documents" in reply["error"]["message"], reply
    assert "[[1, 2, 3]]" in reply["error"]["message"], reply
    status, reply = _post(served_cross_encoder, "/rerank", {"query": "q", "documents": [[1, 2]]})
    assert status == 200 and len(reply["results"]) == 1, reply


def test_rerank_scores_an_empty_query_as_score_does(served_cross_encoder, qwen_ce):
    """An empty query was refused by /rerank while /score scored the same empty text_1 (vLLM scores both: the
    tokenizer's pair of "" and each document): now each relevance equals transformers' and /score's."""
    from transformers import AutoTokenizer
    path, hf = qwen_ce
    want = _pair_scores(hf, AutoTokenizer.from_pretrained(path), "", DOCS)
    status, reply = _post(served_cross_encoder, "/rerank", {"query": "", "documents": DOCS})
    assert status == 200, reply
    got = {r["index"]: r["relevance_score"] for r in reply["results"]}
    torch.testing.assert_close(torch.tensor([got[0], got[1]]), torch.tensor(want), atol=1e-5, rtol=1e-4)
    status, scored = _post(served_cross_encoder, "/score", {"text_1": "", "text_2": DOCS})
    assert status == 200, scored
    torch.testing.assert_close(torch.tensor([d["score"] for d in scored["data"]]), torch.tensor(want), atol=1e-5,
                               rtol=1e-4)
    status, reply = _post(served_cross_encoder, "/rerank", {"query": ["q"], "documents": DOCS})
    assert status == 400 and reply["error"]["message"] == "query must be a text, got list", reply


def test_embedding_model_names_an_empty_query_itself():
    """On an embedding model an empty text has nothing to embed: rerank's empty query is refused naming query (not
    query[0], nor accepted), /score's empty text_1 naming text_1; an empty text of a list keeps its index."""
    gen = _serve("tiny-qwen3", runner="pooling")
    base = next(gen)
    try:
        query = _post(base, "/rerank", {"query": "", "documents": ["a"]})
        text_1 = _post(base, "/score", {"text_1": "", "text_2": ["a"]})
        listed = _post(base, "/score", {"text_1": "a", "text_2": ["b", ""]})
    finally:
        gen.close()
    assert query[0] == 400 and query[1]["error"]["param"] == "query", query
    assert query[1]["error"]["message"].startswith("query is an empty string: there is nothing to embed"), query
    assert text_1[0] == 400 and text_1[1]["error"]["message"].startswith("text_1 is an empty string"), text_1
    assert listed[0] == 400 and "text_2[1] is an empty string" in listed[1]["error"]["message"], listed


def test_deprecated_activation_spellings_are_read(served_classifier, llama3, served_cross_encoder, qwen_ce):
    """vLLM still reads softmax and activation as use_activation (get_use_activation); infer ignored them, so
    {"activation": false} answered softmax probabilities, not the logits. Now both turn the activation off (logits
    equal transformers'), on /classify and on a cross-encoder's /score; a non-boolean or one contradicting
    use_activation is refused naming the field."""
    from transformers import AutoTokenizer
    path, hf = llama3
    ids = AutoTokenizer.from_pretrained(path)("hello world")["input_ids"]
    for old in ("activation", "softmax"):
        status, reply = _post(served_classifier, "/classify", {"input": "hello world", old: False})
        assert status == 200, reply
        check_close([torch.tensor(reply["data"][0]["probs"])], [hf_logits(hf, ids)])
        status, reply = _post(served_classifier, "/classify", {"input": "hi", old: "no"})
        assert status == 400 and reply["error"]["param"] == old, reply
        assert f"{old} must be true or false" in reply["error"]["message"], reply
    status, reply = _post(served_classifier, "/classify", {"input": "hi", "use_activation": True, "activation": False})
    assert status == 400 and reply["error"]["param"] == "activation", reply
    assert "activation false contradicts use_activation true" in reply["error"]["message"], reply
    ce_path, ce = qwen_ce
    pair = AutoTokenizer.from_pretrained(ce_path)("where is the cat", "a dog")["input_ids"]
    status, reply = _post(served_cross_encoder, "/score", {"text_1": "where is the cat", "text_2": "a dog",
                                                           "activation": False})
    assert status == 200, reply
    check_close([torch.tensor([reply["data"][0]["score"]])], [hf_logits(ce, pair)])


def test_infer_run_chat_line_takes_the_template_fields(tmp_path, llama3):
    """A classifier's messages line refused add_generation_prompt and chat_template_kwargs as unknown fields
    (/classify's chat form reads them): now rendered as the template renders them, classified as transformers;
    on a prompt line they are refused as applying to chat messages only."""
    from transformers import AutoTokenizer

    from helpers import infer_run_records
    path, hf = llama3
    tok = AutoTokenizer.from_pretrained(path)
    lines = [{"id": "gen", "messages": CHAT, "add_generation_prompt": True, "chat_template_kwargs": {"x": 1}},
             {"id": "plain", "messages": CHAT, "add_generation_prompt": False},
             {"id": "prompt", "prompt": "hi", "add_generation_prompt": True},
             {"id": "bad", "messages": CHAT, "chat_template_kwargs": "x"}]
    recs, _ = infer_run_records(tmp_path, lines, "--block-size", "4", model=str(path))
    want = {}
    for key, gen in (("gen", True), ("plain", False)):
        ids = list(tok.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=True, return_dict=True)
                   ["input_ids"])
        want[key] = torch.softmax(hf_logits(hf, ids), -1)
        assert recs[key]["error"] is None and recs[key]["usage"]["prompt_tokens"] == len(ids), recs[key]
    assert len(want["gen"]) == 3 and recs["gen"]["usage"]["prompt_tokens"] > recs["plain"]["usage"]["prompt_tokens"]
    check_close([torch.tensor(recs[k]["probs"]) for k in want], list(want.values()))
    assert "add_generation_prompt applies to chat messages only" in recs["prompt"]["error"], recs["prompt"]
    assert "chat_template_kwargs must be an object, got str" in recs["bad"]["error"], recs["bad"]


def test_a_cross_encoders_one_pair_refused_names_its_text(served_cross_encoder):
    """One pair the engine refuses (truncate_prompt_tokens past the context, the pair longer) was named `input`, a
    field a /score or /rerank body does not have: now the pair's text (text_2, documents[0]), as among several."""
    cut = {"truncate_prompt_tokens": 1000}
    for route, body, label in (("/score", {"text_1": "w " * 30, "text_2": "x " * 30, **cut}, "text_2"),
                               ("/rerank", {"query": "w " * 30, "documents": ["x " * 30], **cut}, "documents[0]")):
        status, reply = _post(served_cross_encoder, route, body)
        assert status == 400 and reply["error"]["param"] == label.split("[")[0], reply
        assert reply["error"]["message"].startswith(f"{label}: the prompt has"), reply
        assert "lower truncate_prompt_tokens (1000)" in reply["error"]["message"], reply


def test_classify_input_form_refuses_the_chat_fields(served_classifier):
    """/classify's input form took add_generation_prompt, chat_template_kwargs and chat_template and ignored them
    (the input classified as it is, the client told nothing): refused naming the field, as /v1/completions does."""
    for field, value in (("add_generation_prompt", True), ("chat_template_kwargs", {"a": 1}),
                         ("chat_template", "{{ 'x' }}")):
        status, reply = _post(served_classifier, "/classify", {"input": "hi", field: value})
        assert status == 400 and reply["error"]["param"] == field, reply
        assert reply["error"]["message"].startswith(f"{field} applies to the chat form (messages) only"), reply
    status, reply = _post(served_classifier, "/classify", {"input": "hi", "add_generation_prompt": None})
    assert status == 200, reply
