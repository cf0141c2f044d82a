"""Classification, scoring and reranking (vLLM's pooling runner): a *ForSequenceClassification model (tiny Llama of
three labels, tiny Qwen3 of one: a cross-encoder) gives transformers' softmax/sigmoid of its logits through
LLM.classify, LLM.score and the server's /classify, /score and /rerank routes; an embedding model scores pairs by
cosine similarity; the other runner's requests and bad bodies get clear errors."""

from __future__ import annotations

import shutil

import pytest
import torch

from infer import LLM, PoolingParams
from infer.errors import ConfigError, RequestError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts

LENGTHS = (11, 3, 17, 1, 8)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
DOCS = ["the cat sat on the mat", "a dog", "hello world, again and again", "b c d e f g"]


def build_classifier(src_name: str, folder, num_labels: int, seed: int):
    """A *ForSequenceClassification folder from a built-in tiny model: its decoder and a random score head (no pad
    token: transformers scores the last token); returns (folder, transformers' model in float32)."""
    from transformers import AutoModelForSequenceClassification
    src = ensure_builtin(src_name)
    shutil.copytree(src, folder)
    torch.manual_seed(seed)
    kw = {"id2label": LABELS} if num_labels == 3 else {}
    hf = AutoModelForSequenceClassification.from_pretrained(src, num_labels=num_labels, dtype=torch.float32, **kw)
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)
    hf.config.pad_token_id = None
    hf.save_pretrained(folder)
    return folder, hf.eval()


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return build_classifier("tiny-llama", tmp_path_factory.mktemp("cls") / "llama3", 3, seed=1)


@pytest.fixture(scope="module")
def qwen_ce(tmp_path_factory):
    return build_classifier("tiny-qwen3", tmp_path_factory.mktemp("cls") / "qwen_ce", 1, seed=2)


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


def test_one_label_is_a_sigmoid_and_pooler_config_turns_it_off(qwen_ce):
    path, hf = qwen_ce
    prompts = random_prompts(hf.config.vocab_size, LENGTHS, seed=4)
    logits = [hf_logits(hf, p) for p in prompts]
    with LLM(str(path), runner="pooling", block_size=4) as llm:
        check_close(probs(llm.classify(prompts)), [torch.sigmoid(x) for x in logits])
    with LLM(str(path), block_size=4, pooler_config={"use_activation": False}) as llm:
        check_close(probs(llm.classify(prompts)), logits)
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
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)
    assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == sorted(range(len(DOCS)), key=lambda i: -want[i])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairwise]),
                               torch.tensor([_pair_scores(hf, tok, DOCS[i], [DOCS[i + 2]])[0] for i in (0, 1)]),
                               atol=1e-5, rtol=1e-4)


def test_embedding_model_scores_are_cosine_similarities():
    from transformers import AutoTokenizer

    from lora_helpers import hf_float
    path = ensure_builtin("tiny-qwen3")
    hf, tok = hf_float(path), AutoTokenizer.from_pretrained(path)

    def vec(text):
        with torch.no_grad():
            return hf.model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]
    want = [torch.nn.functional.cosine_similarity(vec("a cat"), vec(d), dim=0).item() for d in DOCS]
    with LLM(str(path), runner="pooling", block_size=4) as llm:
        got = [o.outputs.score for o in llm.score("a cat", DOCS)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


def test_runner_refusals(llama3):
    """A classifier generates and embeds nothing; an embedding model classifies nothing; scoring pairs needs one
    label; peft's SEQ_CLS adapters (modules_to_save on the score head) are refused."""
    path, hf = llama3
    with LLM(str(path), block_size=4) as llm:
        with pytest.raises(RequestError, match="only supported for generative models"):
            llm.generate(["hi"])
        with pytest.raises(RequestError, match="is a classifier"):
            llm.embed(["hi"])
        with pytest.raises(RequestError, match="has 3 labels: scoring a pair needs a cross-encoder"):
            llm.score("a", "b")
        with pytest.raises(RequestError, match="data_1 has 2 texts and data_2 3"):
            llm.score(["a", "b"], ["c", "d", "e"])
        with pytest.raises(RequestError, match=r"data_2\[1\] is an empty string"):
            llm.score("a", ["b", ""])
    with LLM("tiny-qwen3", runner="pooling", block_size=4) as llm:
        with pytest.raises(RequestError, match="makes embeddings, not classes"):
            llm.classify(["hi"])
    with LLM("tiny-qwen3", block_size=4) as llm:
        with pytest.raises(RequestError, match="runner"):
            llm.classify(["hi"])


def test_peft_seq_cls_adapter_is_refused(llama3, tmp_path):
    from peft import LoraConfig, get_peft_model
    path, hf = llama3
    model = get_peft_model(hf, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "seqcls")
    model.unload()
    with pytest.raises(Exception, match="modules_to_save"):
        with LLM(str(path), block_size=4, enable_lora=True, max_lora_rank=8,
                 loras={"s": str(tmp_path / "seqcls")}) as llm:
            llm.classify(["hi"], lora="s")
