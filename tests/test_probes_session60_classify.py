"""Classification, scoring and reranking (vLLM's pooling runner): a *ForSequenceClassification model (tiny Llama of
three labels, tiny Qwen3 of one: a cross-encoder) gives transformers' softmax/sigmoid of its logits through
LLM.classify, LLM.score and the server's /classify, /score and /rerank routes; an embedding model scores pairs by
cosine similarity; the other runner's requests and bad bodies get clear errors."""

from __future__ import annotations


import pytest
import torch

from infer import LLM, PoolingParams
from infer.errors import ConfigError, LoRAError, RequestError
from infer.models.tiny import ensure_builtin

from helpers import build_score_head_model, random_prompts

LENGTHS = (11, 3, 17, 1, 8)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
DOCS = ["the cat sat on the mat", "a dog", "hello world, again and again", "b c d e f g"]


def build_classifier(src_name: str, folder, num_labels: int, seed: int):
    """A *ForSequenceClassification folder from a built-in tiny model: its decoder and a random score head (no pad
    token: transformers scores the last token); returns (folder, transformers' model in float32)."""
    return build_score_head_model(src_name, folder, "AutoModelForSequenceClassification", num_labels, seed, LABELS,
                                  pad_token_id=None)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return build_classifier("tiny-llama", tmp_path_factory.mktemp("cls") / "llama3", 3, seed=1)


@pytest.fixture(scope="module")
def qwen_ce(tmp_path_factory):
    """A cross-encoder (one label) whose tokenizer joins a pair with its EOS token after each text (as a BERT-like
    pair template: "$A </s> $B </s>"), so a pair is not the two texts run together."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    path, hf = build_classifier("tiny-qwen3", tmp_path_factory.mktemp("cls") / "qwen_ce", 1, seed=2)
    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.eos_token
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A", pair=f"$A {eos} $B:1 {eos}:1", special_tokens=[(eos, tok.convert_tokens_to_ids(eos))])
    tok.save_pretrained(path)
    return path, hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def probs(outs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.probs) for o in outs]


def check_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tokens", [4, 64])
def test_classify_probs_equal_transformers_softmax(llama3, tokens):
    """Three labels: softmax of transformers' logits of the last token, whole or in chunks of 4 tokens; runner auto
    pools a ForSequenceClassification; use_activation false gives the logits."""
    path, hf = llama3
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=3)
    logits = [hf_logits(hf, p) for p in prompts]
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)
    with LLM(str(path), block_size=4, max_num_batched_tokens=tokens, max_num_seqs=4) as llm:
        assert (llm.engine.pooler.task, llm.engine.pooler.labels) == ("classify", tuple(LABELS.values()))
        outs = llm.classify(prompts)
        check_close(probs(outs), [torch.softmax(x, -1) for x in logits])
        assert all(o.outputs.num_classes == 3 for o in outs) and [o.prompt_token_ids for o in outs] == prompts
        check_close(probs(llm.classify(prompts[:2], PoolingParams(use_activation=False))), logits[:2])
        assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-mistral", "tiny-gemma", "tiny-gemma3", "tiny-phi3",
                                  "tiny-qwen3-moe"])
def test_other_families_classify_as_transformers(tmp_path, name):
    """Each family's ForSequenceClassification (Gemma 3's: Gemma3TextForSequenceClassification) equals
    transformers' softmax, through chunks of 4 tokens."""
    path, hf = build_classifier(name, tmp_path / name, 3, seed=5)
    prompts = random_prompts(hf.config.vocab_size, LENGTHS[:3], seed=6)
    with LLM(str(path), block_size=4, max_num_batched_tokens=4, max_num_seqs=2) as llm:
        check_close(probs(llm.classify(prompts)), [torch.softmax(hf_logits(hf, p), -1) for p in prompts])


def test_one_label_is_a_sigmoid_and_pooler_config_turns_it_off(qwen_ce, monkeypatch):
    path, hf = qwen_ce
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=4)
    logits = [hf_logits(hf, p) for p in prompts]
    with LLM(str(path), runner="pooling", block_size=4) as llm:
        check_close(probs(llm.classify(prompts)), [torch.sigmoid(x) for x in logits])
    with LLM(str(path), block_size=4, pooler_config={"use_activation": False}) as llm:
        check_close(probs(llm.classify(prompts)), logits)
    with pytest.raises(ConfigError, match="is a classifier .* generates no text"):
        LLM(str(path), runner="generate")
    with monkeypatch.context() as m:  # (a model config.py cannot read as a folder: the engine refuses it)
        m.setattr("infer.engine.config.classifier_folder", lambda model: False)
        with pytest.raises(ConfigError, match="is a classifier .* generates no text"):
            LLM(str(path))
    with pytest.raises(ConfigError, match="normalize is for an embedding model"):
        LLM(str(path), pooler_config={"normalize": True})
    with pytest.raises(ConfigError, match="use_activation is for a classifier"):
        LLM("tiny-qwen3", runner="pooling", pooler_config={"use_activation": True})


def _pair_scores(hf, tok, query: str, docs: list[str]) -> list[float]:
    return [torch.sigmoid(hf_logits(hf, tok(query, d)["input_ids"]))[0].item() for d in docs]


def test_cross_encoder_scores_equal_transformers_pair_encoding(qwen_ce):
    """LLM.score of a cross-encoder: sigmoid of transformers' logit of the tokenizer's pair encoding; one text
    against each, and pairwise; the ranking order equals transformers'."""
    from transformers import AutoTokenizer
    path, hf = qwen_ce
    tok = AutoTokenizer.from_pretrained(path)
    want = _pair_scores(hf, tok, "where is the cat", DOCS)
    with LLM(str(path), block_size=4) as llm:
        got = [o.outputs.score for o in llm.score("where is the cat", DOCS)]
        pairwise = llm.score(DOCS[:2], DOCS[2:])
        by_ids = llm.score(tok("where is the cat", add_special_tokens=False)["input_ids"], DOCS[:1])
    assert tok("a", "b")["input_ids"] != tok("ab")["input_ids"]  # (the template joins the pair)
    assert by_ids[0].prompt_token_ids == tok("where is the cat", DOCS[0])["input_ids"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)
    assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == sorted(range(len(DOCS)), key=lambda i: -want[i])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairwise]),
                               torch.tensor([_pair_scores(hf, tok, DOCS[i], [DOCS[i + 2]])[0] for i in (0, 1)]),
                               atol=1e-5, rtol=1e-4)


def hf_cosines(query: str, docs: list[str]) -> list[float]:
    """transformers' cosine similarity of tiny-qwen3's last-token hidden states of the query and each document."""
    from transformers import AutoTokenizer

    from lora_helpers import hf_float
    path = ensure_builtin("tiny-qwen3")
    hf, tok = hf_float(path), AutoTokenizer.from_pretrained(path)

    def vec(text):
        with torch.no_grad():
            return hf.model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]
    return [torch.nn.functional.cosine_similarity(vec(query), vec(d), dim=0).item() for d in docs]


def test_embedding_model_scores_are_cosine_similarities():
    want = hf_cosines("a cat", DOCS)
    with LLM("tiny-qwen3", runner="pooling", block_size=4) as llm:
        got = [o.outputs.score for o in llm.score("a cat", DOCS)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


def test_runner_refusals(llama3):
    """A classifier generates and embeds nothing; an embedding model classifies nothing; scoring pairs needs one
    label; peft's SEQ_CLS adapters (modules_to_save on the score head) are refused."""
    from infer.cli.banner import start_traits
    path, hf = llama3
    with LLM(str(path), block_size=4) as llm:
        assert start_traits(llm.engine).endswith(", a classifier of 3 labels on LAST pooling")
        with pytest.raises(RequestError, match="only supported for generative models"):
            llm.generate(["hi"])
        with pytest.raises(RequestError, match="is a classifier"):
            llm.embed(["hi"])
        with pytest.raises(RequestError, match="has 3 labels: scoring a pair needs a cross-encoder"):
            llm.score("a", "b")
        with pytest.raises(RequestError, match="data_1 has 2 texts and data_2 3"):
            llm.score(["a", "b"], ["c", "d", "e"])
    with LLM("tiny-qwen3", runner="pooling", block_size=4) as llm:
        with pytest.raises(RequestError, match="makes embeddings, not classes"):
            llm.classify(["hi"])
        with pytest.raises(RequestError, match=r"data_2\[1\] is an empty string"):  # (nothing to embed)
            llm.score("a", ["b", ""])
    with LLM("tiny-qwen3", block_size=4) as llm:
        with pytest.raises(RequestError, match="runner"):
            llm.classify(["hi"])


def test_peft_seq_cls_adapter_is_refused(llama3, tmp_path):
    from peft import LoraConfig, get_peft_model
    path, hf = llama3
    model = get_peft_model(hf, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "seqcls")
    model.unload()
    with pytest.raises(LoRAError, match="has modules_to_save"):
        with LLM(str(path), block_size=4, enable_lora=True, max_lora_rank=8,
                 loras={"s": str(tmp_path / "seqcls")}) as llm:
            llm.classify(["hi"], lora="s")


def _serve(path, **kw):
    """Yields the base URL of the model at `path` served (pooling runner, runner auto) in a thread as "cls"."""
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    kw = {"max_model_len": 32, "max_num_seqs": 2, "max_num_batched_tokens": 8, "block_size": 4, **kw}
    engine = LLMEngine(EngineConfig(str(path), **kw))
    with serve_in_thread(Server(AsyncEngine(engine), "cls")) as base:
        yield base


@pytest.fixture(scope="module")
def served_classifier(llama3):
    yield from _serve(llama3[0])


@pytest.fixture(scope="module")
def served_cross_encoder(qwen_ce):
    yield from _serve(qwen_ce[0])


def _post(base: str, route: str, body) -> tuple[int, dict]:
    import httpx
    r = httpx.post(base + route, json=body, timeout=60)
    return r.status_code, r.json()


def test_classify_route_equals_transformers(served_classifier, llama3):
    """POST /classify (vLLM's ClassificationResponse): texts and token ids, more inputs than running slots (waves),
    each entry's probs, its label (id2label of the most probable class), num_classes; usage counts the prompts."""
    from transformers import AutoTokenizer
    path, hf = llama3
    texts = ["hello world", "a b c", "the cat sat", "x"]
    ids = [AutoTokenizer.from_pretrained(path)(t)["input_ids"] for t in texts]
    status, body = _post(served_classifier, "/classify", {"model": "cls", "input": texts})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "cls" and body["id"].startswith("classify-")
    want = [torch.softmax(hf_logits(hf, i), -1) for i in ids]
    check_close([torch.tensor(d["probs"]) for d in body["data"]], want)
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert [d["label"] for d in body["data"]] == [LABELS[int(w.argmax())] for w in want]
    assert all(d["num_classes"] == 3 for d in body["data"])
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(map(len, ids))
    status, one = _post(served_classifier, "/classify", {"input": ids[0], "use_activation": False})
    assert status == 200, one
    check_close([torch.tensor(one["data"][0]["probs"])], [hf_logits(hf, ids[0])])


def test_score_and_rerank_routes_equal_transformers(served_cross_encoder, qwen_ce):
    """/score and /v1/score: one score per pair; /rerank, /v1/rerank, /v2/rerank: the documents by relevance,
    highest first, top_n of them, with their text unless return_documents is false."""
    from transformers import AutoTokenizer
    path, hf = qwen_ce
    want = _pair_scores(hf, AutoTokenizer.from_pretrained(path), "where is the cat", DOCS)
    for route in ("/score", "/v1/score"):
        status, body = _post(served_cross_encoder, route, {"text_1": "where is the cat", "text_2": DOCS})
        assert status == 200, body
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["data"][0]["object"] == "score"
        torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), torch.tensor(want),
                                   atol=1e-5, rtol=1e-4)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, body = _post(served_cross_encoder, route, {"query": "where is the cat", "documents": DOCS,
                                                            "top_n": 3})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == order[:3]
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order[:3]]
        torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in body["results"]]),
                                   torch.tensor([want[i] for i in order[:3]]), atol=1e-5, rtol=1e-4)
        assert body["usage"]["total_tokens"] > 0
    status, body = _post(served_cross_encoder, "/rerank", {"query": "where is the cat", "documents": DOCS,
                                                           "return_documents": False})
    assert status == 200 and [r["index"] for r in body["results"]] == order, body
    assert all("document" not in r for r in body["results"])


@pytest.mark.parametrize("route, body, message", [
    ("/rerank", {"query": "q", "documents": []}, "documents must be a non-empty list of texts, got an empty list"),
    ("/rerank", {"query": "q", "documents": "d"}, "documents must be a non-empty list of texts, got str"),
    ("/rerank", {"query": 5, "documents": ["d"]}, "query must be a text, got int"),
    ("/rerank", {"query": "q", "documents": ["d", 5]}, "documents[1] is neither a text nor a list of token ids"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n must be a non-negative integer"),
    ("/rerank", {"query": "q", "documents": ["d"], "return_documents": "yes"}, "return_documents must be"),
    ("/rerank", {"documents": ["d"]}, "query is required"),
    ("/score", {"text_1": "a", "text_2": ["w " * 40]}, "the pair has"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2 texts and text_2 3"),
    ("/score", {"text_1": "a", "text_2": "b", "use_activation": "no"}, "use_activation must be true, false"),
    ("/classify", {"input": []}, "input is an empty list"),
])
def test_routes_refuse_bad_bodies(served_cross_encoder, route, body, message):
    got, reply = _post(served_cross_encoder, route, body)
    assert got == 400 and message in reply["error"]["message"], reply


def test_classify_route_refuses_bad_inputs(served_classifier):
    for body, message in (({"input": []}, "input is an empty list"), ({"input": 5}, "input must be text"),
                          ({"input": [5] * 40}, "the prompt has 40 tokens"), ({}, "input is required")):
        got, reply = _post(served_classifier, "/classify", body)
        assert got == 400 and message in reply["error"]["message"], reply
    got, reply = _post(served_classifier, "/score", {"text_1": "a", "text_2": "b"})
    assert got == 400 and "has 3 labels" in reply["error"]["message"], reply


@pytest.mark.parametrize("route, api", [("/v1/completions", "Completions"), ("/v1/embeddings", "Embeddings")])
def test_classifier_server_refuses_generation_and_embeddings(served_classifier, route, api):
    status, reply = _post(served_classifier, route, {"prompt": "hi", "input": "hi"})
    assert status == 400 and reply["error"]["message"].startswith(f"The model does not support {api} API"), reply


def test_generation_server_refuses_the_pooling_routes():
    from helpers import served_tiny_llama
    gen = served_tiny_llama()
    base = next(gen)
    try:
        replies = [_post(base, route, body) for route, body in (
            ("/classify", {"input": "hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
            ("/v2/rerank", {"query": "a", "documents": ["b"]}))]
    finally:
        gen.close()
    for (status, reply), api in zip(replies, ("Classification", "Score", "Rerank")):
        assert status == 400 and reply["error"]["message"].startswith(f"The model does not support {api} API")
        assert "--runner pooling" in reply["error"]["message"]


def test_embedding_server_reranks_by_cosine_and_refuses_classify():
    want = hf_cosines("a cat", DOCS)
    gen = _serve("tiny-qwen3", runner="pooling")
    base = next(gen)
    try:
        status, body = _post(base, "/v1/rerank", {"query": "a cat", "documents": DOCS})
        refused = _post(base, "/classify", {"input": "hi"})
    finally:
        gen.close()
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in body["results"]]),
                               torch.tensor(sorted(want, reverse=True)), atol=1e-5, rtol=1e-4)
    assert refused[0] == 400 and "makes embeddings, not classes" in refused[1]["error"]["message"], refused


def test_gptq_classifier_equals_transformers_on_dequantized_weights(tmp_path, llama3):
    """A GPTQ int4 decoder (infer quantize) with a float score head and a ForSequenceClassification config.json:
    softmax of the score head on transformers' last hidden state of the dequantized weights. infer quantize
    refuses the classifier itself (GPTQModel writes a causal LM: the head would be lost)."""
    import json

    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from infer.cli.main import app
    from quant_helpers import dequantized_float_model, has_gptqmodel, infer_quantize
    res = CliRunner().invoke(app, ["quantize", str(llama3[0]), "-o", str(tmp_path / "no")])
    assert res.exit_code != 0 and "is a classifier (LlamaForSequenceClassification)" in res.output, res.output
    if not has_gptqmodel():
        pytest.skip("needs the quantize extra (gptqmodel)")
    out = infer_quantize("tiny-llama", tmp_path / "gptq")
    hf = dequantized_float_model(ensure_builtin("tiny-llama"), out)
    score = llama3[1].score.weight.detach().clone()
    weights = load_file(out / "model.safetensors")
    save_file({**weights, "score.weight": score}, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=["LlamaForSequenceClassification"], id2label={str(k): v for k, v in LABELS.items()},
               label2id={v: k for k, v in LABELS.items()})
    (out / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=12)
    with torch.no_grad():
        want = [torch.softmax(hf.model(torch.tensor([p])).last_hidden_state[0, -1] @ score.T, -1) for p in prompts]
    with LLM(str(out), block_size=4, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.qweight is not None
        got = probs(llm.classify(prompts))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=5e-4, rtol=1e-3)


def test_infer_run_refuses_embedding_and_scoring_lines_on_a_classifier(tmp_path, llama3):
    """infer run on a classifier (runner auto: pooling): an embeddings line is told the model is a classifier; a
    line of a score, rerank or classify url is told to go to a server; the others still run."""
    from helpers import infer_run_records
    lines = [{"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "hi"}},
             {"custom_id": "s", "url": "/v1/score", "body": {"text_1": "a", "text_2": "b"}},
             {"custom_id": "r", "url": "/v2/rerank", "body": {"query": "a", "documents": ["b"]}},
             {"custom_id": "g", "url": "/v1/completions", "body": {"prompt": "hi"}}]
    recs, _ = infer_run_records(tmp_path, lines, "--block-size", "4", "--output-format", "openai", key="custom_id",
                                model=str(llama3[0]))
    assert "is a classifier" in recs["e"]["error"]["message"], recs["e"]
    for key, url in (("s", "/v1/score"), ("r", "/v2/rerank")):
        assert f"url {url!r}: infer run does not answer classify, score or rerank lines" in \
            recs[key]["error"]["message"], recs[key]
    assert "only supported for generative models" in recs["g"]["error"]["message"], recs["g"]
