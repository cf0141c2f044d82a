"""Probes of the fifty-third session: infer's Python API where vLLM code would break or read a different value
(RequestOutput.lora_request, EngineArgs, max_logprobs, beam records' rank)."""

from __future__ import annotations

import pytest

from infer.models.tiny import ensure_builtin

from lora_helpers import THREE, hf_float, save_adapter

P_LEN = [5, 9, 13, 21]


@pytest.fixture(scope="module")
def path():
    return str(ensure_builtin("tiny-llama"))


@pytest.fixture(scope="module")
def adapters(path, tmp_path_factory):
    root = tmp_path_factory.mktemp("va")
    hf = hf_float(path)
    return {name: save_adapter(hf, root / name, seed=i + 7, **THREE[name]) for i, name in enumerate(("a", "b"))}


def test_request_output_carries_the_lora_request(path, adapters):
    """vLLM's RequestOutput.lora_request (and CompletionOutput.lora_request) is the LoRARequest the request ran with,
    None without an adapter: `out.lora_request.lora_name` was an AttributeError. The object given as lora_request= is
    handed back; an adapter named by lora= (registered by add_lora) reads as a LoRARequest of its name and folder,
    with an id of its own."""
    from infer import LLM, LoRARequest, SamplingParams
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with LLM(path, block_size=4, max_model_len=64, enable_lora=True, max_lora_rank=8) as llm:
        a = LoRARequest("a", 1, str(adapters["a"]))
        base, with_a = llm.generate([P_LEN, P_LEN], params, lora_request=[None, a])
        assert base.lora_request is None and base.outputs[0].lora_request is None
        assert with_a.lora_request is a and with_a.outputs[0].lora_request is a
        llm.add_lora("b", str(adapters["b"]))
        out = llm.generate(P_LEN, SamplingParams(max_tokens=2, ignore_eos=True, n=2), lora="b")[0]
        got = out.lora_request
        assert (got.lora_name, got.lora_path, got.lora_int_id) == ("b", str(adapters["b"]), 2)
        assert [o.lora_request for o in out.outputs] == [got, got]
        streamed = [o for _, _, o in llm.stream(P_LEN, params, lora="a")]
        assert all(o.lora_request is a for o in streamed)
        engine = llm.llm_engine
        engine.add_request("r", P_LEN, params, lora_request=a)
        while engine.has_unfinished_requests():
            for o in engine.step():
                assert o.lora_request is a


def test_beam_search_logprobs_carry_vllms_rank(path):
    """vLLM's BeamSearchSequence.logprobs are {token id: Logprob(logprob, rank, decoded_token)} per token: a vLLM
    program reading `beam.logprobs[k][token].logprob` or `.rank` failed on infer's bare floats, and the served beam
    search's logprob records lacked the `rank` that sampled tokens' records carry. Each candidate is now a float
    with vLLM's fields (the values compare and add as before), and the served records carry the token's rank."""
    import pickle

    from infer import LLM, BeamSearchParams
    from infer.engine.beam import Logprob
    from infer.serve.beams import beam_output
    with LLM(path, block_size=4, max_model_len=64) as llm:
        best = llm.beam_search([P_LEN], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences[0]
        tokenizer = llm.get_tokenizer()
    assert len(best.logprobs) == 3
    for token, options in zip(best.output_token_ids, best.logprobs):
        chosen = options[token]
        assert isinstance(chosen.rank, int) and chosen.rank >= 1 and chosen.logprob == float(chosen)
        assert chosen.rank == 1 + sum(v > chosen for v in options.values())  # (ties: as vLLM's, itself included)
        assert all(isinstance(v, Logprob) and v.decoded_token is None for v in options.values())
    assert best.cum_logprob == pytest.approx(sum(o[t] for t, o in zip(best.output_token_ids, best.logprobs)))
    assert pickle.loads(pickle.dumps(best.logprobs[0])) == best.logprobs[0]
    assert pickle.loads(pickle.dumps(chosen)).rank == chosen.rank
    out = beam_output("c", best, tokenizer, False, 2)
    assert [r["rank"] for r in out.logprobs] == [o[t].rank for t, o in zip(best.output_token_ids, best.logprobs)]
    assert all(type(r["logprob"]) is float for r in out.logprobs)
