"""Session 60 review of gpt-oss (p60ross): its harmony replies split by `--reasoning-parser openai_gptoss` (vLLM's
name) as vLLM's gpt-oss reasoning parser splits them, in infer serve (whole and streamed) and infer run's OpenAI
batch lines, on a tokenizer whose harmony markers are special tokens as gpt-oss's o200k_harmony tokenizer's are;
`infer convert`, `infer lora-validate` and the bench's transformers baseline of the hub's MXFP4 layout; reload_weights
of another experts' config."""

from __future__ import annotations

import functools
import json

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from infer import LLM, SamplingParams  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.llm_engine import LLMEngine  # noqa: E402
from infer.serve.app import Server, serve_in_thread  # noqa: E402
from infer.serve.async_engine import AsyncEngine  # noqa: E402
from infer.serve.reasoning import ReasoningRequest, parts, split  # noqa: E402

from helpers import (check_equal_transformers, check_reload_refuses_a_changed_config_field,  # noqa: E402
                     forced_chat_body, infer_run_records, joined_deltas, random_prompts, streamed_chat_choices,
                     tiny_llama_with_added_tokens)
from test_probes_session60_gptoss import build, to_mxfp4  # noqa: E402

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
HARMONY = ReasoningRequest("openai_gptoss")
# replies as gpt-oss writes them after its chat template's prompt (which ends with <|start|>assistant)
ANSWER = "<|channel|>analysis<|message|>The user asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4."
TWO_THOUGHTS = ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
                "<|start|>assistant<|channel|>final<|message|>c<|return|>")
TOOL = ("<|channel|>analysis<|message|>call it<|end|><|start|>assistant<|channel|>commentary to=functions.f "
        "<|constrain|>json<|message|>{\"x\": 1}<|call|>")
MESSAGES = [{"role": "user", "content": "2+2?"}]


@pytest.mark.parametrize("text,want", [
    (ANSWER, ("The user asks 2+2.", "4.")),
    (TWO_THOUGHTS, ("a\nb", "c")),  # analysis messages joined by a newline (vLLM's parse_chat_output)
    ("<|channel|>analysis<|message|>still thinking", ("still thinking", None)),  # cut short in the analysis
    ("<|channel|>analysis<|message|>done<|end|>", ("done", None)),
    ("<|channel|>final<|message|>xyz", (None, "xyz")),  # no analysis (reasoning_effort low may skip it)
    (TOOL, ("call it", "{\"x\": 1}")),  # a commentary channel's text is content
    ("plain text", (None, "plain text")),  # no harmony markers: all content
])
def test_a_harmony_reply_splits_by_channel(text, want):
    assert split(HARMONY, text) == want


@pytest.mark.parametrize("text", [ANSWER, TWO_THOUGHTS, TOOL])
def test_a_streamed_harmony_reply_only_grows_and_ends_as_the_whole(text):
    """Each prefix of the reply (a stream's text so far, cut anywhere, in a marker too): both parts only grow, no
    marker's text leaks into either, and the last equals the whole reply's split."""
    seen = ("", "")
    for n in range(len(text) + 1):
        now = parts(HARMONY, text[:n], finished=False)
        assert now[0].startswith(seen[0]) and now[1].startswith(seen[1]), (text[:n], now, seen)
        assert not any("<|" in p for p in now), (text[:n], now)
        seen = now
    assert seen == parts(HARMONY, text)


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    return tiny_llama_with_added_tokens(tmp_path_factory.mktemp("ross") / "harmony", MARKERS, special=True)


_body = functools.partial(forced_chat_body, MESSAGES, max_tokens=60)  # _body(reply, **extra)


def test_infer_serve_splits_a_harmony_reply(harmony_model):
    """--reasoning-parser openai_gptoss was "not available": a gpt-oss chat reply's content was its channels' text
    run together without the (special) markers ("analysisThe user asks 2+2.assistantfinal4."). Now the analysis
    channel is the message's reasoning, the final channel its content, whole and streamed; without the parser the
    text is as before."""
    engine = LLMEngine(EngineConfig(harmony_model, block_size=4, max_num_seqs=4))
    channel = engine.tokenizer.convert_tokens_to_ids("<|channel|>")
    with serve_in_thread(Server(AsyncEngine(engine), "gpt-oss", reasoning_parser="openai_gptoss")) as base:
        for reply, want in [(ANSWER, ("The user asks 2+2.", "4.")), (TWO_THOUGHTS, ("a\nb", "c"))]:
            r = httpx.post(f"{base}/v1/chat/completions", json=_body(reply, return_token_ids=True), timeout=120)
            assert r.status_code == 200, r.text
            assert channel in r.json()["choices"][0]["token_ids"]  # the markers are the reply's special tokens
            message = r.json()["choices"][0]["message"]
            assert (message["reasoning"], message["content"]) == want, reply
            deltas = streamed_chat_choices(base, _body(reply))
            assert (joined_deltas(deltas, "reasoning"), joined_deltas(deltas, "content")) == want, reply
    with serve_in_thread(Server(AsyncEngine(engine), "gpt-oss")) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(ANSWER), timeout=120)
        message = r.json()["choices"][0]["message"]
        assert "reasoning" not in message and message["content"].startswith("analysisThe user asks 2+2."), message


def test_infer_run_splits_harmony_batch_lines(harmony_model, tmp_path):
    """infer run --output-format openai --reasoning-parser openai_gptoss: each chat line's message split as the
    server's (the markers kept in the text for the split, as the server keeps them)."""
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": _body(ANSWER)}
    recs, printed = infer_run_records(tmp_path, [line], "--output-format", "openai", "--reasoning-parser",
                                      "openai_gptoss", key="custom_id", model=harmony_model)
    message = recs["a"]["response"]["body"]["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("The user asks 2+2.", "4."), printed


def test_infer_convert_of_an_mxfp4_checkpoint_writes_the_float_model(tmp_path):
    """`infer convert` of the hub's gpt-oss layout (MXFP4 experts) failed: transformers' load fetched its MXFP4
    kernels from the hub ("could not verify publisher trust status", or no network). It now dequantizes them as
    `infer run` does and writes the float model without the quantization_config (transformers and vLLM load it as
    float): its tokens and logprobs are transformers' of the MXFP4 folder dequantized."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from typer.testing import CliRunner

    from infer.cli.main import app
    src, out = tmp_path / "mxfp4", tmp_path / "float"
    build(src, hidden_size=64, intermediate_size=64)
    to_mxfp4(src)
    res = CliRunner().invoke(app, ["convert", str(src), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    hf.generation_config.eos_token_id = None
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # (float: no quantizer)
    assert torch.equal(converted.model.layers[1].mlp.experts.down_proj, hf.model.layers[1].mlp.experts.down_proj)
    prompts = random_prompts(512, (5, 13), seed=3)
    with LLM(str(out), block_size=4, dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=0))
    check_equal_transformers(hf, prompts, outs, 8, "converted")


@pytest.mark.parametrize("key,value", [("swiglu_limit", 2.5), ("num_experts_per_tok", 3)])
def test_reload_weights_refuses_another_expert_config(tmp_path, key, value):
    """gpt-oss's swiglu_limit (the experts' clamp) and the routing's top k are read when the layers are built: a
    reload_weights whose config.json changed them kept the old values (tokens of neither model). Refused naming
    the field; the engine runs on."""
    check_reload_refuses_a_changed_config_field(tmp_path, "tiny-gpt-oss", key, value)


def test_lora_validate_and_the_hf_baseline_load_an_mxfp4_base(tmp_path):
    """`infer lora-validate` of an attention adapter on the hub's gpt-oss layout (MXFP4 experts) died with
    transformers' traceback (its peft reference loaded the base with the hub's MXFP4 kernels, which it could not
    fetch), and so did the bench's transformers baseline (load_hf). Both now load it dequantized, as infer does:
    the adapter agrees with peft's."""
    import shutil

    from typer.testing import CliRunner

    from infer.bench.hf_baseline import load_hf
    from infer.cli.main import app
    from lora_helpers import save_adapters
    hf = build(tmp_path / "float", hidden_size=64, intermediate_size=64)
    adapter = save_adapters(hf, tmp_path, {"att": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                              "o_proj"])})["att"]
    shutil.copytree(tmp_path / "float", tmp_path / "mxfp4")
    to_mxfp4(tmp_path / "mxfp4")
    res = CliRunner().invoke(app, ["lora-validate", str(tmp_path / "mxfp4"), str(adapter), "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    loaded = load_hf(str(tmp_path / "mxfp4"), dtype="float32", device="cpu")
    assert type(loaded.model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"  # (dequantized)


def test_infer_quantize_of_an_mxfp4_checkpoint_names_the_convert_step(tmp_path):
    """`infer quantize` of the hub's gpt-oss (MXFP4) said "quantize the float model it came from", which OpenAI does
    not publish: the refusal now names `infer convert`, which writes that float model (test above)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    build(tmp_path / "m", hidden_size=64, intermediate_size=64)
    to_mxfp4(tmp_path / "m")
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "m"), "-o", str(tmp_path / "q")], env={"COLUMNS": "250"})
    assert res.exit_code == 2, res.output
    assert "already quantized (quant_method 'mxfp4')" in res.output and "infer convert" in res.output


def test_the_cli_takes_openai_gptoss_and_the_openai_tool_parser():
    """vLLM serves gpt-oss with --reasoning-parser openai_gptoss --tool-call-parser openai: infer takes both (the
    openai parser was refused until session 61, which reads harmony's calls: test_probes_session61_tools)."""
    from infer.cli.serve import _reasoning_parser, _tool_parser
    assert _reasoning_parser("openai_gptoss") == "openai_gptoss"
    assert _tool_parser(True, "openai") == "openai"
