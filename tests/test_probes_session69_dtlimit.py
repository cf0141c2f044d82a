"""A Mamba-2 time_step_limit that clamps (models.granite4.Mamba2Mixer, shared by Granite 4.0, Bamba, Falcon-H1 and
Nemotron-H): transformers clamps dt in a prompt's scan and not in a decode step's. infer computes some prompt tokens
alone (the last token of a prompt cut into steps, the one token a prefix-cached prompt leaves): the model runner
marks them (ForwardContext.dt_clamp) and the mixer scans them, clamped. Each family: transformers' greedy tokens and
every token's logprob, and the decode graphs replayed for generated tokens alone."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.models.tiny import ensure_builtin

from helpers import check_prompt_logprobs_equal_transformers, check_state_slots_all_free, hf_model, random_prompts

LIMIT = [0.05, 0.5]  # (the tiny models' softplus(dt + dt_bias) lies on both sides of it)
FAMILIES = ("tiny-granite4", "tiny-bamba", "tiny-falcon-h1", "tiny-nemotron-h")


def _limited(name: str, folder, limit=LIMIT):
    """Built-in `name` copied to `folder` with `limit` as its time_step_limit; transformers' model of it."""
    shutil.copytree(ensure_builtin(name), folder)
    config = json.loads((folder / "config.json").read_text())
    config["time_step_limit"] = limit
    (folder / "config.json").write_text(json.dumps(config))
    return hf_model(str(folder))


def _interpret(triton: bool, monkeypatch) -> None:
    """`triton`: every op with a Triton kernel through it, interpreted on a CPU (skipped on a GPU)."""
    if triton:
        if torch.cuda.is_available():
            pytest.skip("a GPU runs the real kernels")
        from infer import kernels
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)


def _generates_as_transformers(hf, prompts, outs, n: int) -> None:
    """`outs` (n greedy tokens of each of `prompts`, logprobs asked) are transformers' generate's tokens and each
    logprob that of its scores within 1e-4: its decode steps, which do not clamp dt (a full forward over prompt and
    reply would clamp every token's)."""
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
        assert out.token_ids == want.sequences[0, len(p):].tolist()
        got = torch.tensor([r["logprob"] for r in out.logprobs])
        lp = torch.stack([s[0].log_softmax(-1)[t] for s, t in zip(want.scores, out.token_ids)])
        assert torch.allclose(got, lp, atol=1e-4), (got - lp).abs().max()


@pytest.mark.parametrize("name,triton", [(name, False) for name in FAMILIES] + [("tiny-granite4", True)])
def test_a_prompts_last_token_alone_is_clamped_as_transformers(name, triton, tmp_path, monkeypatch):
    """(`triton`: every op with a Triton kernel through it, interpreted.) Prompts of 17 and 9 tokens in steps of 8,
    one at a time (their last token a step of its own, its state kept), and a prompt of 37 tokens then another with
    its first 36 (the second finds 9 cached blocks and the state snapshot at their end, and computes its last token
    alone): transformers' greedy tokens, each generated token's logprob (its decode steps unclamped) and every
    prompt token's."""
    _interpret(triton, monkeypatch)
    hf = _limited(name, tmp_path / "m")
    short = random_prompts(512, (17, 9), seed=4)
    base = random_prompts(512, (37,), seed=8)[0]
    again = base[:36] + [7]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    with LLM(str(tmp_path / "m"), block_size=4, max_num_batched_tokens=8, max_num_seqs=1, state_snapshots=2) as llm:
        assert llm.engine.runner.clamps_dt
        outs = llm.generate(short, params)
        # (prompt logprobs would compute the whole prompt: no cache hit)
        cached = [llm.generate([p], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1))[0]
                  for p in (base, again)]
        assert cached[1].num_cached_tokens == 36 and llm.engine.block_manager.snapshots.restored == 1
        check_state_slots_all_free(llm)
    _generates_as_transformers(hf, short + [base, again], outs + cached, 6)
    check_prompt_logprobs_equal_transformers(hf, short, outs)


def test_the_limit_moves_the_tokens_so_the_test_can_fail(tmp_path):
    """The same model without the limit gives other logprobs at a prompt's last token (the clamp binds), and infer
    refuses nothing: Bamba's limit, refused before, is served."""
    hf = _limited("tiny-bamba", tmp_path / "m")
    free = hf_model(str(ensure_builtin("tiny-bamba")))
    prompt = random_prompts(512, (17,), seed=4)[0]
    with torch.no_grad():
        a = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        b = free(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    assert (a - b).abs().max() > 1e-2


def test_decode_graphs_replay_generated_tokens_alone(tmp_path, monkeypatch):
    """Emulated decode graphs with the limit: a one-token step of a prompt's last token runs eagerly (its dt clamped),
    the generated tokens' steps replay the graphs; transformers' tokens."""
    hf = _limited("tiny-granite4", tmp_path / "m")
    prompts = random_prompts(512, (17, 9, 3), seed=12)
    with LLM(str(tmp_path / "m"), max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64,
             max_num_batched_tokens=8, cuda_graph_max_tokens=8) as llm:
        runner = llm.engine.runner
        runner.capture_graphs(64, emulate=True)
        eager = []
        fits = runner.graphs.fits

        def spy(num_new_tokens, ctx):
            ok = fits(num_new_tokens, ctx)
            if ctx.max_query_len == 1 and not ok:
                eager.append(ctx.dt_clamp.tolist())
            return ok
        monkeypatch.setattr(runner.graphs, "fits", spy)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=1))
        assert runner.graphs.replays and eager and all(any(step) for step in eager)
        check_state_slots_all_free(llm)
    _generates_as_transformers(hf, prompts, outs, 5)


@pytest.mark.parametrize("triton", [False, True])
def test_a_preempted_sequence_recomputes_its_reply_unclamped(triton, tmp_path, monkeypatch):
    """(`triton`: as above.) A KV budget of 16 blocks of 4 for 4 prompts: the preempted ones recompute prompt and
    reply in one prefill from zero state, dt clamped for the prompt's tokens alone (the reply's were decode steps):
    transformers' generate's tokens and logprobs."""
    _interpret(triton, monkeypatch)
    hf = _limited("tiny-granite4", tmp_path / "m")
    prompts = random_prompts(512, (20, 25, 17, 30), seed=4)
    with LLM(str(tmp_path / "m"), block_size=4, num_kv_blocks=16, max_model_len=64) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=1))
        assert llm.engine.scheduler.num_preemptions > 0
        check_state_slots_all_free(llm)
    _generates_as_transformers(hf, prompts, outs, 12)
