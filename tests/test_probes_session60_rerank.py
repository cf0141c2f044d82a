"""LLM rerankers (vLLM's online conversion of a causal LM into a classifier): config.json's method and
classifier_from_token (what vLLM's --hf-overrides sets; Qwen3-Reranker's is_original_qwen3_reranker) make the score
head from lm_head's rows of those tokens. A tiny random Qwen3 whose tokenizer holds "no" and "yes" scores a pair as
Qwen3-Reranker's model card does in transformers (the causal LM's last-token logits of [no, yes], log_softmax, exp
of yes = sigmoid(yes - no)), through LLM.score, LLM.classify, /score and /rerank; bad configs are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.errors import ModelLoadError, UnknownOptionError, UnsupportedModelError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from quant_helpers import make_gptqmodel_checkpoint, needs_gptqmodel
from test_probes_session60_classify import _post, _serve, check_close, probs

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}  # (vLLM's --hf-overrides for Qwen3-Reranker)
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY = PREFIX + "<Instruct>: Given a web search query, retrieve relevant passages\n<Query>: where is the cat\n"
DOCS = [f"<Document>: {d}{SUFFIX}" for d in ("the cat sat on the mat", "a dog", "hello world, again", "b c d e")]


def reranker_folder(folder, tied: bool = False, **config):
    """tiny-qwen3 with "no" and "yes" added to its tokenizer (their embedding and head rows drawn at random), saved as
    a causal LM, then config.json edited as RERANKER updated with `config`; returns (folder, transformers' causal LM
    in float32, the tokenizer)."""
    folder, hf, tok = causal_folder(folder, tied)
    as_reranker(folder, **config)
    return folder, hf, tok


def as_reranker(folder, **config) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **RERANKER, **config}))


def causal_folder(folder, tied: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = ensure_builtin("tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens(["no", "yes"])
    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if tied:
        hf.config.tie_word_embeddings = True
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.resize_token_embeddings(len(tok), pad_to_multiple_of=64)  # (as real vocabularies: GPTQ packs the rows)
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    with torch.no_grad():
        for p in {id(p): p for p in (hf.get_input_embeddings().weight, hf.get_output_embeddings().weight)}.values():
            p[tok.convert_tokens_to_ids(["no", "yes"])] = torch.randn(2, p.shape[1])
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, hf.eval(), tok


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return reranker_folder(tmp_path_factory.mktemp("rerank") / "qwen3-reranker")


def model_card_score(hf, tok, ids: list[int]) -> float:
    """Qwen3-Reranker's model card: log_softmax over the last token's [no, yes] logits, exp of yes; checked equal to
    sigmoid(yes - no), vLLM's from_2_way_softmax."""
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    with torch.no_grad():
        last = hf(torch.tensor([ids])).logits[0, -1].float()
    card = torch.nn.functional.log_softmax(torch.stack([last[no], last[yes]]), dim=0)[1].exp()
    torch.testing.assert_close(card, torch.sigmoid(last[yes] - last[no]))
    return card.item()


def card_scores(hf, tok, query: str, docs: list[str]) -> list[float]:
    """vLLM's pair of an LLM reranker (use_pad_token false): the two texts as one, text_1 + text_2."""
    return [model_card_score(hf, tok, tok(query + d)["input_ids"]) for d in docs]


@pytest.mark.parametrize("tokens", [4, 64])
def test_qwen3_reranker_scores_equal_the_model_cards_yes_no(reranker, tokens):
    """LLM.score: the card's score of query + document (whole, or in chunks of 4 tokens), one query against each
    document and pairwise; LLM.classify of token ids: the same of the prompt (trailing pad tokens kept, unlike a
    *ForSequenceClassification's pooling); one label, a float32 head of the difference of the rows, no vocabulary
    head kept."""
    path, hf, tok = reranker
    want = card_scores(hf, tok, QUERY, DOCS)
    assert max(want) - min(want) > 1e-2  # (the documents score apart)
    with LLM(str(path), block_size=4, max_num_batched_tokens=tokens, max_num_seqs=4) as llm:
        model = llm.engine.runner.model
        assert llm.engine.pooler.labels == ("LABEL_0",) and not hasattr(model, "lm_head")
        no, yes = tok.convert_tokens_to_ids(["no", "yes"])
        head = hf.lm_head.weight
        torch.testing.assert_close(model.score.weight, (head[yes] - head[no])[None].float(), atol=0, rtol=0)
        outs = llm.score(QUERY, DOCS)
        assert [o.prompt_token_ids for o in outs] == [tok(QUERY + d)["input_ids"] for d in DOCS]
        pairwise = llm.score([QUERY + "x", QUERY], DOCS[:2])
        prompts = random_prompts(hf.config.vocab_size, (9, 1, 5), seed=12)
        assert hf.config.pad_token_id == 0  # (the causal LM's last token, a pad token too: vLLM's, the card's)
        prompts.append(prompts[0] + [0, 0])
        classified = llm.classify(prompts)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]), torch.tensor(want), atol=1e-5,
                               rtol=1e-4)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairwise]),
                               torch.tensor(card_scores(hf, tok, QUERY + "x", DOCS[:1]) + want[1:2]), atol=1e-5,
                               rtol=1e-4)
    check_close(probs(classified), [torch.tensor([model_card_score(hf, tok, p)]) for p in prompts])


def test_rerank_route_orders_documents_as_the_model_card(reranker):
    """POST /rerank and /score of the converted reranker: the card's scores, documents highest first."""
    path, hf, tok = reranker
    want = card_scores(hf, tok, QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for base in _serve(path, max_model_len=256, max_num_batched_tokens=64):
        status, body = _post(base, "/rerank", {"query": QUERY, "documents": DOCS})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == order
        torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in body["results"]]),
                                   torch.tensor([want[i] for i in order]), atol=1e-5, rtol=1e-4)
        status, body = _post(base, "/score", {"text_1": QUERY, "text_2": DOCS[0]})
        assert status == 200, body
        assert body["data"][0]["score"] == pytest.approx(want[0], abs=1e-5)


def test_tied_head_and_no_post_processing_tokens(tmp_path):
    """A tied output head gives the embeddings' rows; method no_post_processing (vLLM's, bge-reranker-v2-gemma's):
    a label a token, its raw row: one token is a sigmoid of its logit, two a softmax over them; use_pad_token true
    (vLLM's) joins the pair as the tokenizer joins two texts."""
    path, hf, tok = reranker_folder(tmp_path / "tied", tied=True, is_original_qwen3_reranker=False,
                                    method="no_post_processing", classifier_from_token=["yes"])
    prompts = random_prompts(hf.config.vocab_size, (7, 3), seed=13)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    with torch.no_grad():
        last = [hf(torch.tensor([p])).logits[0, -1].float() for p in prompts]
    pair = ("the ca", "t sat")
    assert tok(*pair)["input_ids"] != tok("".join(pair))["input_ids"]
    with LLM(str(path), block_size=4) as llm:
        check_close(probs(llm.classify(prompts)), [torch.sigmoid(x[[yes]]) for x in last])
        assert llm.score(*pair)[0].prompt_token_ids == tok("".join(pair))["input_ids"]
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "use_pad_token": True}))
    with LLM(str(path), block_size=4) as llm:
        assert llm.score(*pair)[0].prompt_token_ids == tok(*pair)["input_ids"]
    (path / "config.json").write_text(json.dumps({**cfg, "classifier_from_token": ["no", "yes"]}))
    with LLM(str(path), block_size=4) as llm:
        assert llm.engine.pooler.labels == ("LABEL_0", "LABEL_1")
        check_close(probs(llm.classify(prompts)), [torch.softmax(x[[no, yes]], -1) for x in last])


@pytest.mark.parametrize("change, error, message", [
    ({"classifier_from_token": ["no", "maybe not"]}, ModelLoadError,
     'classifier_from_token has "maybe not", not one token of'),
    ({"classifier_from_token": ["no", "yes", "ok"]}, UnsupportedModelError,
     "method from_2_way_softmax takes two tokens in classifier_from_token, \\[false, true\\], got 3"),
    ({"classifier_from_token": "yes"}, UnsupportedModelError, "classifier_from_token must be a non-empty list"),
    ({"is_original_qwen3_reranker": False}, UnsupportedModelError, 'give config.json both "method"'),
    ({"method": "from_3_way"}, UnsupportedModelError, 'method "from_3_way" is not one infer runs'),
    ({"architectures": ["Qwen3ForCausalLM"]}, UnsupportedModelError,
     "architectures are not a \\*ForSequenceClassification"),
])
def test_bad_reranker_configs_are_refused(reranker, tmp_path, change, error, message):
    path = shutil.copytree(reranker[0], tmp_path / "bad")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(error, match=message):
        LLM(str(path))


@needs_gptqmodel
def test_a_gptq_reranker_with_a_quantized_head_scores_from_its_dequantized_rows(tmp_path):
    """A GPTQ checkpoint of the causal LM, its lm_head quantized too (GPTQModel's lm_head=True, 8 bits), made a
    reranker by config.json: each score is sigmoid(yes - no) of the next-token logprobs the same checkpoint gives as a
    causal LM (its quantized head through the GPTQ path, the logprobs of the whole vocabulary)."""
    src, _, tok = causal_folder(tmp_path / "float")
    out = make_gptqmodel_checkpoint(src, tmp_path / "gptq", lm_head=True)
    tok.save_pretrained(out)
    causal = shutil.copytree(out, tmp_path / "causal")
    as_reranker(out)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    prompts = [tok(QUERY + d)["input_ids"] for d in DOCS]
    with LLM(str(causal), max_model_len=256, dtype="float32", max_logprobs=-1) as llm:
        assert llm.engine.runner.model.quantized_head
        records = [o.outputs[0].logprobs[0]["top_logprobs"] for o in
                   llm.generate(prompts, SamplingParams(max_new_tokens=1, logprobs=-1))]
    tops = [{r["token_id"]: r["logprob"] for r in rec} for rec in records]
    want = [torch.sigmoid(torch.tensor(t[yes] - t[no])).item() for t in tops]
    with LLM(str(out), block_size=4, max_model_len=256, dtype="float32") as llm:
        got = [o.outputs.score for o in llm.score(QUERY, DOCS)]
    assert max(want) - min(want) > 1e-3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


def test_hf_overrides_hint_names_the_rerankers_config_fields(reranker):
    """vLLM's --hf-overrides for Qwen3-Reranker is refused with the config.json fields to set; `infer warmup
    --estimate` of the converted reranker counts the weights a load keeps (the score head, no vocabulary head)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.memory.sizes import weights_bytes
    res = CliRunner().invoke(app, ["serve", str(reranker[0]), "--hf-overrides", json.dumps(RERANKER)],
                             env={"COLUMNS": "250"})
    assert res.exit_code != 0 and '"classifier_from_token": ["no", "yes"]' in res.output, res.output
    res = CliRunner().invoke(app, ["serve", str(reranker[0]), "--convert", "classify"], env={"COLUMNS": "250"})
    assert res.exit_code != 0 and "*ForSequenceClassification" in res.output and "classifier_from_token" in res.output
    with pytest.raises(UnknownOptionError, match=r"convert only as .*\*ForSequenceClassification.*classifier_from"):
        LLM(str(reranker[0]), convert="classify")
    res = CliRunner().invoke(app, ["warmup", str(reranker[0]), "--estimate", "--json", "--max-length", "64"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    with LLM(str(reranker[0]), max_model_len=64) as llm:
        assert plan["weights_bytes"] == weights_bytes(llm.engine.runner.model)


def test_a_causal_lm_with_a_method_field_still_generates(tmp_path):
    """`method` alone in a causal LM's config.json (another model's field of that name) is not a reranker's: it loads
    and generates as before."""
    path = shutil.copytree(ensure_builtin("tiny-qwen3"), tmp_path / "causal")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "method": "from_2_way_softmax"}))
    with LLM(str(path)) as llm:
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0].outputs[0]
                   .token_ids) == 2
