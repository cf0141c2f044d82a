"""Session 53 probes of the sampling semantics against vLLM's (vllm/v1/sample: sampler.py, ops/logprobs.py,
sampling_params.py): each test failed before its fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infer.engine.model_runner import ModelRunner
from infer.engine.sampling_params import SamplingParams


def _runner_with_logits(logits: torch.Tensor):
    """What ModelRunner._prompt_logprobs reads of its runner: a model whose logits are `logits`, and the config."""
    model = SimpleNamespace(compute_logits=lambda hidden: logits.index_select(0, hidden.view(-1).long()))
    return SimpleNamespace(model=model, config=SimpleNamespace(max_num_seqs=8), vocab_size=logits.shape[1],
                           device=logits.device)


def test_a_prompt_tokens_rank_counts_the_tokens_it_ties_with_as_vllm():
    """vLLM's rank (batched_count_greater_than) is how many tokens are at least as likely as the token, itself
    included: a token tied with another for the top has rank 2, as has the other. It was 1 + the tokens strictly
    more likely (1 for both), and bf16 logits tie often."""
    logits = torch.tensor([[2.0, 2.0, 0.5, -1.0, 2.0],
                           [0.0, 3.0, 3.0, 1.0, 1.0]])
    seq = SimpleNamespace(params=SamplingParams(prompt_logprobs=1))
    where, targets = torch.tensor([0, 1]), torch.tensor([1, 4])
    hidden = torch.tensor([[0.0], [1.0]])
    rows, _ = ModelRunner._prompt_logprobs(_runner_with_logits(logits), hidden, (where, targets, [(seq, 2)]))
    assert rows[:, 2].tolist() == [3.0, 4.0]  # token 1 ties with 0 and 4; token 4 ties with 3, below 1 and 2


def test_a_generated_tokens_record_carries_its_rank_as_vllm():
    """vLLM's sample logprobs give the sampled token's rank (Logprob.rank: the tokens at least as likely, itself
    included), as its prompt logprobs do; infer's records of generated tokens had none."""
    from infer.engine.sampler import Sampler
    from infer.engine.sequence import Sequence
    logits = torch.tensor([[3.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 1.0, 1.0, 1.0, 0.0]])
    seqs = []
    for k, kw in ((1, dict(logit_bias={1: 50.0})), (0, dict(allowed_token_ids=[1])), (None, {})):
        seq = Sequence("r", [1, 2], SamplingParams(logprobs=k, **kw))
        seq.bad_words, seq.min_tokens_ban = [], []
        seqs.append(seq)
    tokens, records = Sampler(0)(logits, seqs)
    assert tokens == [1, 1, 0]  # the bias and the allowed list chose them: the ranks are the raw logits'
    assert [r["rank"] for r in records[:2]] == [2, 4]  # token 1 ties with token 0; token 1 under 4, 3, 2
    assert records[0]["top_logprobs"][0]["token_id"] in (0, 1) and records[2] is None
    assert records[0]["logprob"] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())



def test_a_positive_temperature_below_vllms_floor_samples_at_it():
    """vLLM raises a temperature in (0, 0.01) to 0.01 (_MAX_TEMP) before its greedy check (_SAMPLING_EPS, 1e-5),
    so temperature 1e-6 samples at 0.01. infer decoded every temperature below 1e-5 greedily: two tokens 0.01 apart
    were 73% / 27% in vLLM and 100% / 0% here."""
    from infer.engine.sampler import Sampler
    from infer.engine.sequence import Sequence
    params = SamplingParams(temperature=1e-6)
    assert params.temperature == 0.01 and not params.greedy
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=0.5).temperature == 0.5
    logits = torch.tensor([[0.0, -0.01, -5.0, -9.0]])
    seen = set()
    for seed in range(200):  # token 1 missing from 200 draws: 0.73 ** 200, about 1e-27
        seq = Sequence("r", [1], SamplingParams(temperature=1e-6, seed=seed).checked())
        seq.bad_words, seq.min_tokens_ban = [], []
        seen.add(Sampler(0)(logits, [seq])[0][0])
    assert seen == {0, 1}


def test_a_stream_takes_prompt_logprobs_zero_as_vllm_and_refuses_more():
    """vLLM refuses prompt_logprobs with stream=True only when it is above 0 (or -1): 0 is taken (a stream returns
    no prompt logprobs). infer refused 0 too, a 400 for a body vLLM serves."""
    from infer.engine.setup import load_tokenizer
    from infer.models.tiny import ensure_builtin
    from infer.serve.protocol import ApiError, parse_chat, parse_completion
    tok = load_tokenizer(ensure_builtin("tiny-llama"))
    messages = [{"role": "user", "content": "hi"}]
    for parse, body in ((parse_completion, {"prompt": "hello"}), (parse_chat, {"messages": messages})):
        req = parse({**body, "max_tokens": 2, "stream": True, "prompt_logprobs": 0}, tok)
        assert req.params.prompt_logprobs is None  # nothing to compute: a stream would not return them
        assert parse({**body, "max_tokens": 2, "prompt_logprobs": 0}, tok).params.prompt_logprobs == 0
        for value in (1, -1, False):
            with pytest.raises(ApiError, match="not streamed"):
                parse({**body, "max_tokens": 2, "stream": True, "prompt_logprobs": value}, tok)
