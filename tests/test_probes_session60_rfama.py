"""Session 60 (review of famA: SmolLM3, Seed-OSS, ERNIE 4.5 dense): what a vLLM user deploying them meets beyond the
forward that tests/test_probes_session60_famA.py checks against transformers. Seed-OSS's reasoning block is
<seed:think>...</seed:think> (vLLM's `--reasoning-parser seed_oss`, SeedOSSReasoningParser: deepseek_r1's rules with
those tags); SmolLM3's is <think>...</think>, which deepseek_r1 and qwen3 already split."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.serve.reasoning import ReasoningRequest, parts, prompt_ends_reasoning, reasoning_request, split

from helpers import (TOOLS_TEMPLATE, check_equal_transformers, check_stray_sliding_window, check_stream_adds_up,
                     forced_chat_body, joined_deltas, random_prompts, streamed_chat_choices,
                     tiny_llama_with_added_tokens, tiny_llama_with_template)
from test_probes_session60_famA import build

SEED = ReasoningRequest("seed_oss")


# ------------------------------------------------------------------------------------ Seed-OSS's reasoning parser
@pytest.mark.parametrize("text,want", [
    ("<seed:think>abc</seed:think>xyz", ("abc", "xyz")),
    ("abc</seed:think>xyz", ("abc", "xyz")),  # no opening tag: reasoning from the start (BaseThinkingReasoningParser)
    ("<seed:think>abc", ("abc", None)),  # cut short in the block: all reasoning
    ("<seed:think>a</think>b</seed:think>c", ("a</think>b", "c")),  # <think> tags are text to this parser
    ("</seed:think>xyz", ("", "xyz")),
])
def test_seed_oss_splits_a_whole_reply_by_its_own_tags(text, want):
    assert split(SEED, text) == want
    assert split(ReasoningRequest("deepseek_r1"), "<think>a</think>b") == ("a", "b")  # the others' tags unchanged


@pytest.mark.parametrize("text", ["<seed:think>abc</seed:think>xyz", "<seed:th", "ab</seed:thi", "<seed:think>x</se"])
def test_a_seed_oss_stream_holds_back_its_partial_tags_and_adds_up(text):
    check_stream_adds_up(SEED, text)
    assert parts(SEED, "<seed:th", finished=False) == ("", "")
    assert parts(SEED, "<seed:think>ab</seed:th", finished=False) == ("ab", "")


def test_a_prompt_that_closes_the_seed_oss_block_ends_the_reasoning():
    from infer.engine.setup import load_tokenizer
    from infer.models.tiny import ensure_builtin
    tok = load_tokenizer(str(ensure_builtin("tiny-llama")))
    closed = tok.encode("user: hi\nassistant: <seed:think>\n</seed:think>\n")
    opened = tok.encode("user: hi\nassistant: <seed:think>\n")
    assert prompt_ends_reasoning(closed, tok, "seed_oss") and not prompt_ends_reasoning(opened, tok, "seed_oss")
    assert reasoning_request("seed_oss", {}, closed, tok).ended
    assert not reasoning_request("seed_oss", {}, opened, tok).ended
    # as vLLM's seed_oss, it reads no enable_thinking
    assert not reasoning_request("seed_oss", {"chat_template_kwargs": {"enable_thinking": False}}, opened, tok).ended


def test_seed_oss_tags_that_are_special_tokens_stay_in_the_text():
    """Where the tokenizer holds <seed:think> and </seed:think> as special tokens, the reply keeps them
    (skip_special_tokens off) so that seed_oss can split it; <think> tags are what the other parsers look for."""
    from infer.engine.setup import load_tokenizer
    from infer.models.tiny import ensure_builtin
    from infer.serve.reasoning import tags_are_skipped
    tok = load_tokenizer(str(ensure_builtin("tiny-llama")))
    assert not tags_are_skipped(tok, "seed_oss")
    tok.add_special_tokens({"additional_special_tokens": ["<seed:think>", "</seed:think>"]})
    assert tags_are_skipped(tok, "seed_oss") and not tags_are_skipped(tok, "deepseek_r1")


def test_seed_oss_tags_held_as_special_tokens_split_served_and_batch_replies(tmp_path):
    """A tokenizer whose <seed:think> and </seed:think> are special tokens (left out of a reply's text): the server's
    chat reply and `infer run`'s OpenAI batch line keep them to split the reply, whole and streamed."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("xgrammar")
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    model = tiny_llama_with_added_tokens(tmp_path / "seed-special", ["<seed:think>", "</seed:think>"], special=True)
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=4))
    messages = [{"role": "user", "content": "think, then answer"}]
    body = forced_chat_body(messages, "<seed:think>abc</seed:think>xyz", 40)
    with serve_in_thread(Server(AsyncEngine(engine), "seed", reasoning_parser="seed_oss")) as base:
        message = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("abc", "xyz")
        deltas = streamed_chat_choices(base, body)
        assert (joined_deltas(deltas, "reasoning"), joined_deltas(deltas, "content")) == ("abc", "xyz")
    engine.close()
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    res = CliRunner().invoke(app, ["run", model, str(src), "-o", str(tmp_path / "out.jsonl"), "-q", "--output-format",
                                   "openai", "--reasoning-parser", "seed_oss"])
    assert res.exit_code == 0, res.output
    [record] = map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    message = record["response"]["body"]["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("abc", "xyz")


def test_the_cli_takes_seed_oss():
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.cli.serve import _reasoning_parser
    assert _reasoning_parser("seed_oss") == "seed_oss"
    res = CliRunner().invoke(app, ["serve", "tiny-llama", "--reasoning-parser", "step3"])
    assert res.exit_code != 0 and "deepseek_r1 | qwen3 | seed_oss" in res.output


def test_a_server_with_seed_oss_splits_the_reasoning_whole_and_streamed(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("xgrammar")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    model = str(tiny_llama_with_template(tmp_path / "tiny-seed", TOOLS_TEMPLATE))
    engine = LLMEngine(EngineConfig(model, block_size=4, max_num_seqs=4))
    messages = [{"role": "user", "content": "think, then answer"}]
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-seed", reasoning_parser="seed_oss")) as base:
        for reply, reasoning, content in [("<seed:think>abc</seed:think>xyz", "abc", "xyz"),
                                          ("abc</seed:think>", "abc", None)]:
            body = forced_chat_body(messages, reply, 160)
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == (reasoning, content), reply
            deltas = streamed_chat_choices(base, body)
            assert joined_deltas(deltas, "reasoning") == reasoning
            assert joined_deltas(deltas, "content") == (content or "")
            assert not any("think>" in (d["delta"].get("content") or "") + (d["delta"].get("reasoning") or "")
                           for d in deltas)


# ------------------------------------------------------------------------------ a stray sliding_window in config.json
@pytest.mark.parametrize("family", ["seed_oss", "ernie4_5"])
def test_a_stray_sliding_window_caps_the_context_and_slides_no_layer(tmp_path, family):
    """Seed-OSS's and ERNIE 4.5's attention (transformers') never slides, while generate()'s cache keeps only the
    last sliding_window keys of a config that has the key and no layer_types: as a Llama's, their context is capped
    at the window, every layer attending fully (infer slid every layer over it, which neither of transformers' ways
    computes), and within it the tokens are transformers'."""
    check_stray_sliding_window(tmp_path, build(tmp_path, family, sliding_window=16), family)


# ------------------------------------------------------------------------------- SmolLM3's long context (YaRN)
def test_smollm3_with_yarn_equals_transformers_past_the_original_context(tmp_path):
    """SmolLM3-3B's 128k context is YaRN over its 64k (rope_scaling in config.json): the rope layers rotate by the
    scaled table (its attention factor in cos and sin), the NoPE layers by none; prompts past
    original_max_position_embeddings give transformers' tokens and logprobs."""
    hf = build(tmp_path, "smollm3", max_position_embeddings=256,
               rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32})
    assert hf.model.rotary_emb.attention_scaling != 1.0
    prompts = random_prompts(512, (60, 100), seed=5)
    with LLM(str(tmp_path), block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, "smollm3-yarn")


@pytest.mark.parametrize("option", ["--hf-overrides", "--rope-scaling", "--rope-theta"])
@pytest.mark.parametrize("command", ["serve", "run"])
def test_vllms_config_overrides_say_to_edit_config_json(tmp_path, command, option):
    """vLLM's --hf-overrides / --rope-scaling (how SmolLM3-3B's card turns YaRN on) are refused naming config.json's
    rope_scaling, not with click's guess."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    args = ["serve", "tiny-smollm3"] if command == "serve" else ["run", "tiny-smollm3", str(tmp_path / "in.jsonl")]
    res = CliRunner().invoke(app, [*args, option, '{"rope_type": "yarn"}'], env={"COLUMNS": "250"})
    assert res.exit_code != 0 and f"{option} is vLLM's option" in res.output
    assert "config.json" in res.output and '"rope_scaling": {"rope_type": "yarn"' in res.output


# ------------------------------------------------------------------------------- the real checkpoints' configs
HUB = {  # the fields of SmolLM3-3B's, Seed-OSS-36B's and ERNIE-4.5-0.3B-PT's config.json, at small sizes
    "smollm3": dict(no_rope_layers=[1, 1, 1, 0], no_rope_layer_interval=4, rope_scaling=None, rope_theta=5000000.0,
                    sliding_window=None, use_sliding_window=False, max_window_layers=28, attention_dropout=0.0,
                    pretraining_tp=2, tie_word_embeddings=True),
    "seed_oss": dict(rope_scaling={"rope_type": "default"}, rope_theta=10000000.0, attention_dropout=0.1,
                     residual_dropout=0.1, head_dim=128, attention_bias=True, attention_out_bias=False, mlp_bias=False),
    "ernie4_5": dict(head_dim=128, rope_theta=500000, tie_word_embeddings=True, use_bias=False, use_cache=False),
}


@pytest.mark.parametrize("family", HUB)
def test_the_real_checkpoints_config_fields_equal_transformers(tmp_path, family):
    """Their config.json fields as the hub has them (Seed-OSS's and ERNIE's head_dim of 128 apart from hidden_size /
    heads, their dropouts, rope_theta 5e6 / 1e7 / 5e5, tied heads, SmolLM3's Qwen2-style window fields with
    use_sliding_window false): transformers' tokens and logprobs."""
    hf = build(tmp_path, family, **HUB[family])
    prompts = random_prompts(512, (5, 40), seed=3)
    with LLM(str(tmp_path), block_size=4) as llm:
        assert all(layer.self_attn.window == 0 for layer in llm.engine.runner.model.layers)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 8, family)


# ------------------------------------------------------------------------------------- EAGLE-3 on these targets
@pytest.mark.parametrize("family", ["smollm3", "ernie4_5"])
def test_eagle_heads_drive_a_smollm3_or_ernie_target(tmp_path, monkeypatch, family):
    """vLLM runs EAGLE-3 on SmolLM3 (its Llama) and ERNIE 4.5 (its Llama subclass); infer refused them ("needs a
    target of the Llama family"). The head's drafts equal the independent reference over transformers' hidden states
    of the target (NoPE layers, interleaved rotary), and greedy output equals a run without speculation; an EAGLE-1
    head's drafts equal its reference too."""
    from test_probes_session56_eagle import check_eagle_heads_drive
    arch = {"smollm3": "SmolLM3ForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM"}[family]
    check_eagle_heads_drive(tmp_path, monkeypatch, family, arch, {})
