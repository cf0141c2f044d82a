"""Review of per-token pooling (vLLM's token_embed / token_classify, POST /pooling): the default task of /pooling and
of infer run's /pooling lines is the model's own (vLLM's ModelConfig.get_pooling_task: embed, classify, or a token
classifier's token_classify); a per-token request preempted mid-prompt recomputes its rows, none duplicated;
AsyncLLM.encode takes a per-token task; a token classifier's refusals of generation name what it is."""

from __future__ import annotations

import asyncio

import pytest
import torch

from infer import LLM, PoolingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.errors import ConfigError, RequestError
from infer.models.tiny import ensure_builtin

from helpers import random_prompts
from lora_helpers import hf_float
from test_probes_session60_classify import _post, _serve, build_classifier
from test_probes_session62_pool import build_token_classifier, check_rows, hf_hidden, hf_token_logits


@pytest.fixture(scope="module")
def tok_llama(tmp_path_factory):
    return build_token_classifier("tiny-llama", tmp_path_factory.mktemp("rtok") / "llama", seed=4)


def test_preempted_token_classify_recomputes_its_rows(tok_llama):
    """Per-token requests preempted mid-prompt (as sleep(mode="keep") pauses them: a recompute) after a chunk or two
    of 4 tokens: each one's rows are its prompt's, once each, as transformers' (none kept from before), and the rows
    it had gathered are let go as it is preempted (they held device memory outside the KV cache while it waited)."""
    path, hf = tok_llama
    prompts = random_prompts(hf.config.vocab_size, (14, 13, 15, 12), seed=21)
    engine = LLMEngine(EngineConfig(str(path), block_size=4, max_num_seqs=4, max_model_len=16,
                                    max_num_batched_tokens=8))
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, PoolingParams(task="token_classify"))
        outs, steps = {}, 0
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
            steps += 1
            if steps in (1, 3):
                for seq in list(engine.scheduler.running):
                    if 0 < seq.num_computed_tokens < len(seq.prompt_token_ids):
                        assert seq.pool_rows is not None
                        engine.scheduler.preempt(seq)
                        assert seq.pool_rows is None  # (what it held on the device is let go while it waits)
        assert engine.stats()["num_preemptions"] > 0  # (the point of the setup)
        check_rows([outs[str(i)] for i in range(4)], [torch.softmax(hf_token_logits(hf, p), -1) for p in prompts])
    finally:
        engine.close()


def test_async_encode_takes_a_per_token_task():
    """AsyncLLM.encode with PoolingParams(task="token_embed") (what vLLM's server hands it): every token's row."""
    from infer.serve.async_llm import AsyncLLM
    path = ensure_builtin("tiny-qwen3")
    hf = hf_float(path)
    ids = random_prompts(hf.config.vocab_size, (7,), seed=5)[0]
    want = torch.nn.functional.normalize(hf_hidden(hf, ids), dim=-1)

    async def run():
        llm = AsyncLLM("tiny-qwen3", runner="pooling", block_size=4)
        try:
            return [o async for o in llm.encode({"prompt_token_ids": ids}, PoolingParams(task="token_embed"), "r")]
        finally:
            llm.shutdown()
    outs = asyncio.run(run())
    check_rows(outs[-1:], [want])


def test_pooling_route_default_task_is_the_models(tmp_path):
    """vLLM's /pooling without a task runs the model's own (get_pooling_task): a sequence classifier's one class
    distribution of the prompt, not a row per token (token_classify only when asked)."""
    from transformers import AutoTokenizer
    path, hf = build_classifier("tiny-llama", tmp_path / "seq", 3, seed=9)
    ids = AutoTokenizer.from_pretrained(path)("the cat sat")["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
        rows = hf.score(hf.model(torch.tensor([ids])).last_hidden_state[0]).float()
    for base in _serve(path):
        status, body = _post(base, "/pooling", {"input": ids})
        assert status == 200, body
        torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), torch.softmax(logits, -1), atol=1e-5,
                                   rtol=1e-4)
        status, body = _post(base, "/pooling", {"input": ids, "task": "token_classify"})
        assert status == 200, body
        torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), torch.softmax(rows, -1), atol=1e-5,
                                   rtol=1e-4)


def test_infer_run_pooling_lines_default_to_the_models_task(tmp_path):
    """infer run lines of url /pooling without a task: an embedding model's one normalized vector (embed), as the
    server's; token_embed's rows when asked."""
    from helpers import infer_run_records
    path = ensure_builtin("tiny-qwen3")
    hf = hf_float(path)
    ids = random_prompts(hf.config.vocab_size, (6,), seed=13)[0]
    hidden = torch.nn.functional.normalize(hf_hidden(hf, ids), dim=-1)
    lines = [{"custom_id": "own", "url": "/pooling", "body": {"input": ids}},
             {"custom_id": "rows", "url": "/pooling", "body": {"input": ids, "task": "token_embed"}}]
    recs, _ = infer_run_records(tmp_path, lines, "--block-size", "4", "--runner", "pooling", "--output-format",
                                "openai", key="custom_id", model=str(path))
    torch.testing.assert_close(torch.tensor(recs["own"]["response"]["body"]["data"][0]["data"]), hidden[-1],
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(recs["rows"]["response"]["body"]["data"][0]["data"]), hidden, atol=1e-5,
                               rtol=1e-4)


def test_token_classifier_refuses_generation_naming_what_it_is(tok_llama, tmp_path):
    """A token classifier's refusals of generation name a *ForTokenClassification model and what it does (they
    said a *ForSequenceClassification model answering /classify, /score and /rerank, which it refuses); infer
    bench --url refuses its server as a classifier's."""
    from infer import SamplingParams
    from infer.cli.bench import check_embeds
    from infer.engine.inputs import parse_request
    path, _ = tok_llama
    for base in _serve(path):
        status, reply = _post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 400, reply
        assert "token classifier (a *ForTokenClassification" in reply["error"]["message"], reply
        assert "/pooling" in reply["error"]["message"] and "ForSequence" not in reply["error"]["message"], reply
        with pytest.raises(ConfigError, match=r"'cls' at .* is a classifier .*ForTokenClassification"):
            check_embeds(base, "cls", {})  # (infer bench --url: it was taken for a generation server)
    with LLM(str(path), block_size=4) as llm:
        with pytest.raises(RequestError, match=r"token classifier \(a \*ForTokenClassification") as e:
            llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        assert "token_classify" in e.value.hint and "ForSequence" not in str(e.value)
        from infer.cli.batch_io import model_names
        names = model_names(llm.engine.config)
    with pytest.raises(RequestError, match=r"\*ForTokenClassification model\): a line classifies every token"):
        parse_request({"prompt": "hi", "max_tokens": 3}, llm.tokenizer, "0", names=names)


def test_data_parallel_pooling_route_of_a_token_classifier(tok_llama):
    """--data-parallel-size 2 (in-process replicas behind tests/fakeray.py): POST /pooling without a task gives
    every input's rows (the token classifier's own task), inputs spread over both replicas, as transformers'."""
    pytest.importorskip("fastapi")
    from fakeray import FakeRay, Handle
    from infer.parallel.replica import Replica
    from infer.parallel.serve_engine import RayAsyncEngine, ReplicaView
    from infer.serve.app import Server, serve_in_thread
    path, hf = tok_llama
    cfg = EngineConfig(str(path), max_model_len=32, max_num_seqs=2, max_num_batched_tokens=4, block_size=4)
    replicas = [Replica(cfg) for _ in range(2)]
    engine = replicas[0].engine
    view = ReplicaView(engine.config, engine.model_path, engine.tokenizer, replicas[0].info())
    aengine = RayAsyncEngine(FakeRay(), [Handle(r) for r in replicas], [r.info() for r in replicas], view)
    prompts = random_prompts(hf.config.vocab_size, (3, 9, 5, 7, 2), seed=17)
    with serve_in_thread(Server(aengine, "cls")) as base:
        status, body = _post(base, "/pooling", {"input": prompts})
    assert status == 200, body
    for d, p in zip(body["data"], prompts):
        torch.testing.assert_close(torch.tensor(d["data"]), torch.softmax(hf_token_logits(hf, p), -1), atol=1e-5,
                                   rtol=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_token_embed_rows_through_cuda_graphs_are_their_own():
    """A float32 model's token_embed rows, not normalized, gathered over chunks of 8 tokens run by (emulated,
    piecewise) CUDA graphs: each chunk's rows are copies, not views of the graphs' static hidden states that the
    next replay overwrites."""
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    prompts = random_prompts(hf.config.vocab_size, (5, 9, 1, 20, 3, 13), seed=1)
    with LLM(str(path), runner="pooling", max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64,
             cuda_graph_max_tokens=16, max_num_batched_tokens=8) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        outs = llm.encode(prompts, PoolingParams(normalize=False), pooling_task="token_embed")
        assert llm.engine.stats()["piecewise_graph_steps"] > 1
    check_rows(outs, [hf_hidden(hf, p) for p in prompts])


def test_encode_reads_the_task_of_its_params():
    """LLM.encode(prompts, PoolingParams(task="token_embed")) without pooling_task runs the params' task (vLLM's
    params carry it): it ran the model's embed, one vector, silently; a call whose task differs from its params'
    is refused (vLLM's "You cannot overwrite"), not overwritten."""
    path = ensure_builtin("tiny-qwen3")
    hf = hf_float(path)
    prompts = random_prompts(hf.config.vocab_size, (6, 3), seed=19)
    with LLM(str(path), runner="pooling", block_size=4, max_num_batched_tokens=8, max_num_seqs=2) as llm:
        outs = llm.encode(prompts, PoolingParams(task="token_embed", normalize=False))
        check_rows(outs, [hf_hidden(hf, p) for p in prompts])
        with pytest.raises(RequestError, match=r"pooling_params.task 'token_embed' differs from the task of "
                                               r"LLM.embed\(\)"):
            llm.embed(prompts, PoolingParams(task="token_embed"))
        with pytest.raises(RequestError, match=r"pooling_params.task 'embed' differs .*pooling_task='token_embed'"):
            llm.encode(prompts, [PoolingParams(), PoolingParams(task="embed")], pooling_task="token_embed")


def test_token_rows_are_held_in_the_models_dtype_and_gathered_in_float32():
    """A bfloat16 model's token_embed over chunks of 4 tokens: the rows a prompt's chunks leave are held in
    bfloat16 while it runs (float32 copies took twice the device memory, outside the KV cache, for a long
    prompt's rows), and its rows come back in float32, as the prompt run in one chunk (to bfloat16's precision)."""
    prompt = random_prompts(256, (13,), seed=23)[0]
    got = {}
    for tokens in (4, 16):
        engine = LLMEngine(EngineConfig("tiny-qwen3", runner="pooling", dtype="bfloat16", block_size=4,
                                        max_num_seqs=2, max_num_batched_tokens=tokens, max_model_len=16))
        try:
            engine.add_request("r", prompt, PoolingParams(task="token_embed", normalize=False))
            held = []
            while engine.has_unfinished_requests():
                outs = engine.step()
                held += [s.pool_rows[-1].dtype for s in engine.scheduler.running if s.pool_rows]
                got.update({tokens: o.outputs.data for o in outs if o.finished})
        finally:
            engine.close()
        assert held == ([torch.bfloat16] * 3 if tokens == 4 else [])
    assert got[4].dtype == torch.float32 and got[4].shape == (13, got[16].shape[-1])
    torch.testing.assert_close(got[4], got[16], atol=2e-2, rtol=2e-2)  # (bfloat16's precision: kernels per chunk)


def test_score_names_a_dict_that_is_no_prompt():
    """LLM.score's data given a dict that is not vLLM's prompt dict ({} or {"text": ...}) is named as such (it was
    "must be a text or a non-empty list of texts, got dict", though prompt dicts are taken)."""
    with LLM("tiny-qwen3", runner="pooling", block_size=4) as llm:
        with pytest.raises(RequestError, match=r"data_1 is a dict of no keys, which is no prompt") as e:
            llm.score({}, "b")
        assert '{"prompt": text}' in e.value.hint
        with pytest.raises(RequestError, match=r"data_2\[1\] is a dict of 'text', which is no prompt"):
            llm.score("a", [{"prompt": "b"}, {"text": "c"}])


def test_per_token_and_sequence_requests_sharing_a_prefix_in_one_batch():
    """An embedding engine with prefix caching, chunks of 8 tokens: token_embed and embed requests of a shared
    12-token prefix added together (each admission may find the blocks the earlier ones compute in the same step):
    every token_embed row and every embed vector is transformers', the per-token ones computing every token."""
    path = ensure_builtin("tiny-qwen3")
    hf = hf_float(path)
    prompts = random_prompts(hf.config.vocab_size, (17, 14, 19, 13), seed=29)
    for p in prompts[1:]:
        p[:12] = prompts[0][:12]
    tasks = ["embed", "token_embed", "embed", "token_embed"]
    engine = LLMEngine(EngineConfig(str(path), runner="pooling", enable_prefix_caching=True, block_size=4,
                                    max_num_seqs=4, max_num_batched_tokens=8, max_model_len=32))
    try:
        for i, (p, task) in enumerate(zip(prompts, tasks)):
            engine.add_request(str(i), p, PoolingParams(task=task))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        engine.close()
    hidden = [torch.nn.functional.normalize(hf_hidden(hf, p), dim=-1) for p in prompts]
    check_rows([outs[str(i)] for i in range(4)], [h if t == "token_embed" else h[-1] for h, t in zip(hidden, tasks)])
    assert [outs[str(i)].num_cached_tokens for i in (1, 3)] == [0, 0]
    assert outs["2"].num_cached_tokens > 0  # (the point of the setup: the embed after them reads the cache)
