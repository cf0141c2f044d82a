"""Review of the pooling runner (embeddings): POST /v1/embeddings names the field a refusal is about, refuses the
body fields it would otherwise drop (add_special_tokens false) and takes vLLM's priority; infer bench refuses a
pooling runner before it runs."""

from __future__ import annotations

import json

import pytest

from test_probes_session59_embed import _post, served_pooling  # noqa: F401 (a fixture)


@pytest.mark.parametrize("body, param, says", [
    ({"input": "x" * 2000}, "input", "context"),  # a text certainly past the context (was param "the")
    ({"input": [list(range(3, 40))]}, "input", "37 tokens"),  # refused by the engine (was param "prompt")
    ({"input": [[3, 100000]]}, "input", "outside the vocabulary"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka"),  # (was param "prompt")
    ({"input": "hi", "add_special_tokens": False}, "add_special_tokens", "add_special_tokens=false"),  # (was dropped)
    ({"input": "hi", "priority": "high"}, "priority", "priority must be an integer"),
    ({"input": "hi", "priority": 3}, "priority", "scheduling"),  # (was dropped: vLLM refuses it without the policy)
])
def test_embeddings_refusals_name_the_field(served_pooling, body, param, says):  # noqa: F811
    base, _, _ = served_pooling
    status, got = _post(base, "/v1/embeddings", body)
    assert status == 400, got
    assert got["error"]["param"] == param, got
    assert says in got["error"]["message"], got


def test_embeddings_priority_zero_and_special_tokens_true_are_taken(served_pooling):  # noqa: F811
    """What a client may always send: the defaults, and null."""
    base, _, _ = served_pooling
    want = _post(base, "/v1/embeddings", {"input": "hi"})
    for extra in ({"priority": 0}, {"priority": None}, {"add_special_tokens": True}):
        status, got = _post(base, "/v1/embeddings", {"input": "hi", **extra})
        assert status == 200, got
        assert got["data"] == want[1]["data"]


def test_infer_run_counts_the_prompt_tokens_it_embeds(tmp_path, capsys):
    """`infer run --runner pooling` said "0 tokens in ... (0.0 tok/s)", on one engine and with --data-parallel
    (the replicas counted generated tokens only): the prompt tokens embedded, on both."""
    import re

    from fakeray import FakeRay, Handle

    from infer.cli import run as one, run_parallel
    from infer.cli.batch_io import RecordWriter, read_inputs
    from infer.engine.config import EngineConfig
    from infer.parallel.pool import ReplicaPool
    from infer.parallel.replica import Replica
    from test_probes_session59_embed import _line
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(_line(f"e{i}", {"input": p})) + "\n" for i, p in enumerate(prompts)))
    replicas = [Replica(EngineConfig("tiny-llama", runner="pooling", max_model_len=64, max_num_seqs=2,
                                     memory_limit=2 ** 29)) for _ in range(2)]
    tokenizer = replicas[0].engine.tokenizer
    for run in ("one", "dp"):
        lines = read_inputs(inp, tokenizer, {})
        writer = RecordWriter(tmp_path / f"{run}.jsonl", append=False)
        if run == "one":
            assert one._generate(replicas[0].engine, lines, writer, False) == 0
        else:
            pool = ReplicaPool(FakeRay(), [Handle(r) for r in replicas], capacity=2, notify=lambda m: None)
            assert run_parallel._generate(pool, lines, writer, tokenizer, False, task="embed") == 0
        writer.close()
        said = capsys.readouterr().err
        assert re.search(r"3 ok, 0 failed, 9 prompt tokens embedded in [\d.]+ s \([\d,.]+ tok/s", said), said


def test_a_too_long_prompt_is_told_the_room_a_pooling_request_has(served_pooling):  # noqa: F811
    """A pooling request may fill the context (it generates nothing): the refusal of a longer one said "leaves no
    room" and told truncate_prompt_tokens to go one lower than it needs."""
    base, _, _ = served_pooling  # (max_model_len 32)
    ids = list(range(3, 40))
    status, got = _post(base, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 100})
    assert status == 400, got
    assert got["error"]["message"] == ("the prompt has 37 tokens, which is more than the model's context "
                                       "(--max-model-len) of 32 (lower truncate_prompt_tokens (100) to 32 or less)")
    status, got = _post(base, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 32})
    assert status == 200 and got["usage"]["prompt_tokens"] == 32, got


def test_infer_run_lines_for_the_other_runner_are_told_what_to_do(tmp_path):
    """An embeddings line on a generating `infer run` was told of "the server started with --runner pooling"; a
    completions line on a pooling one to "use LLM.embed": each is told the runner, and the line to write."""
    from helpers import infer_run_records
    from test_probes_session59_embed import _line
    lines = [_line("e", {"input": "hi"}), _line("g", {"prompt": "hi", "max_tokens": 2}, "/v1/completions")]
    recs, _ = infer_run_records(tmp_path, lines)
    said = recs["e"]["error"]
    assert "needs the pooling runner" in said and "--runner pooling" in said and "server" not in said, said
    recs, _ = infer_run_records(tmp_path, lines, "--runner", "pooling")
    said = recs["g"]["error"]
    assert "only supported for generative models" in said and "infer run lines of url /v1/embeddings" in said, said
    assert recs["e"]["error"] is None


@pytest.mark.parametrize("kind", ["CLS", "LAST"])
def test_vectors_through_cuda_graphs_are_their_own(kind):
    """A float32 model's CLS row (kept from a prompt's first chunk to its last) and a LAST vector that is not
    normalized were views of the graphs' static hidden states, overwritten by the next step's replay: other rows'
    values (emulated graphs: piecewise ones for these chunks, as on a GPU)."""
    from helpers import random_prompts
    from infer import LLM
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float
    from test_probes_session59_embed import check_close, hf_hidden, pooled, vectors
    path = ensure_builtin("tiny-llama")
    hf = hf_float(path)
    prompts = random_prompts(hf.config.vocab_size, (5, 9, 1, 20, 3, 13), seed=1)
    with LLM(str(path), runner="pooling", pooler_config={"pooling_type": kind, "normalize": False}, max_num_seqs=4,
             block_size=4, num_kv_blocks=64, max_model_len=64, cuda_graph_max_tokens=16,
             max_num_batched_tokens=8) as llm:
        llm.engine.runner.capture_graphs(64, emulate=True)
        got = vectors(llm.embed(prompts))
        assert llm.engine.stats()["piecewise_graph_steps"] > 1
    check_close(got, [pooled(hf_hidden(hf, p), kind, normalize=False) for p in prompts])


def test_start_banners_say_how_a_pooling_engine_pools():
    """`infer serve` / `infer run --runner pooling` (one engine or replicas) said nothing of the vectors served."""
    from infer.cli.banner import replica_traits, start_traits
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    cfg = EngineConfig("tiny-llama", runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": False},
                       max_model_len=32, max_num_seqs=2, block_size=4)
    engine = LLMEngine(cfg)
    assert start_traits(engine).endswith(", max length 32, embeddings of MEAN pooling, not normalized")
    infos = [{"dtype": "float32", "num_blocks": 8, "max_model_len": 32, "pooler": engine.pooler}]
    assert replica_traits(infos, cfg).endswith(" each, max length 32, embeddings of MEAN pooling, not normalized")
    assert "pooling" not in start_traits(LLMEngine(EngineConfig("tiny-llama", max_model_len=32, max_num_seqs=2)))
