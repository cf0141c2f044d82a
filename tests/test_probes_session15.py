"""Fixes from the fifteenth session's probes (model configs against transformers, generation semantics against
vLLM), each with the input that showed the bug."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from infer.engine.setup import eos_ids


@pytest.mark.parametrize("config_eos, generation, want", [
    (271, {"eos_token_id": [72, 73]}, {2, 72, 73}),  # generation_config.json wins over config.json, as in generate
    (271, {"eos_token_id": None}, {2, 271}),  # a null there leaves config.json's
    (271, None, {2, 271}),  # no generation_config.json: config.json's (vLLM builds the generation config from it)
    ([5, 6], {"temperature": 0.7}, {2, 5, 6}),
])
def test_eos_ids_follow_the_generation_config(tmp_path, config_eos, generation, want):
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    got = eos_ids(tmp_path, SimpleNamespace(eos_token_id=config_eos), SimpleNamespace(eos_token_id=2))
    assert got == want


# ---- OpenAI requests that leave sampling out get vLLM's defaults, not greedy ----

from infer.engine.inputs import ModelNames, openai_sampling_defaults, parse_request  # noqa: E402
from infer.errors import RequestError  # noqa: E402
from infer.serve.protocol import ApiError, parse_chat, parse_completion  # noqa: E402


class _Tok:
    """Enough of a tokenizer for the parsers: one id per character, a template that joins the contents."""
    chat_template = "x"

    def __call__(self, text):
        return {"input_ids": [ord(c) % 500 for c in text]}

    def apply_chat_template(self, messages, **kw):
        return {"input_ids": [ord(c) % 500 for m in messages for c in m["content"]]}


def test_openai_defaults_come_from_the_generation_config(tmp_path, caplog):
    assert openai_sampling_defaults(tmp_path) == {"temperature": 1.0}  # no file: OpenAI's temperature
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
         "do_sample": True}))
    assert openai_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                                  "repetition_penalty": 1.05}  # vLLM reads min_p there too
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0, "top_k": "x", "min_p": 2,
                                                                  "temperature": 0.0}))
    assert openai_sampling_defaults(tmp_path) == {"temperature": 0.0}  # invalid values are left out, said
    assert "top_p=0" in caplog.text and "top_k='x'" in caplog.text and "min_p=2" in caplog.text


@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "hi"}),
                                         (parse_chat, {"messages": [{"role": "user", "content": "hi"}]})])
def test_server_fills_the_sampling_a_request_leaves_out(parse, body):
    defaults = {"temperature": 1.0, "top_k": 20}
    assert parse(body, _Tok(), defaults=defaults).params.temperature == 1.0
    assert parse({**body, "temperature": None}, _Tok(), defaults=defaults).params.temperature == 1.0
    got = parse({**body, "temperature": 0, "top_k": 5}, _Tok(), defaults=defaults).params
    assert (got.temperature, got.top_k) == (0, 5)  # what the request says wins
    assert parse(body, _Tok(), defaults=defaults).params.top_k == 20


def test_batch_lines_take_the_defaults_plain_lines_stay_greedy():
    names = ModelNames(sampling=(("temperature", 1.0), ("top_p", 0.9)))
    batch = {"custom_id": "a", "body": {"prompt": "hi"}}
    p = parse_request(batch, _Tok(), "1", {"max_new_tokens": 8}, names).params
    assert (p.temperature, p.top_p, p.max_new_tokens) == (1.0, 0.9, 8)
    p = parse_request({"custom_id": "a", "body": {"prompt": "hi", "temperature": 0}}, _Tok(), "1", {}, names).params
    assert p.temperature == 0
    assert parse_request({"prompt": "hi"}, _Tok(), "1", {}, names).params.temperature == 0  # infer's own format


@pytest.mark.parametrize("chat, value", [(False, False), (True, True)])
def test_add_special_tokens_other_than_infer_does_is_refused(chat, value):
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    with pytest.raises(ApiError) as e:
        (parse_chat if chat else parse_completion)({**body, "add_special_tokens": value}, _Tok())
    assert e.value.param == "add_special_tokens" and "not supported" in e.value.message
    (parse_chat if chat else parse_completion)({**body, "add_special_tokens": not value}, _Tok())  # infer's own
    with pytest.raises(RequestError, match="body.add_special_tokens"):
        parse_request({"custom_id": "a", "body": {**body, "add_special_tokens": value}}, _Tok(), "1")
    assert (parse_chat if chat else parse_completion)({**body, "return_tokens_as_token_ids": True},
                                                      _Tok()).tokens_as_ids  # taken (tests/test_tokens_as_ids.py)


def test_a_running_requests_text_is_what_its_deltas_handed_out():
    """LLM.stream: each step's out.text is the concatenation of the deltas so far, so it only grows and is a prefix
    of the final text; before, it was the raw decode, with a partial stop string that later vanished."""
    from infer import LLM, SamplingParams
    llm = LLM("tiny-llama")
    prompts = ["中文 test 日本語", "é à ü ö", "Hello"] * 3
    params = [SamplingParams(max_new_tokens=40, temperature=1.5, seed=900 + i, ignore_eos=True, stop=["the", "ing"])
              for i in range(len(prompts))]
    sent, finals, held = {}, {}, 0
    for i, delta, out in llm.stream(prompts, params):
        sent[i] = sent.get(i, "") + delta
        assert out.text == sent[i]
        if out.finished:
            finals[i] = out.text
        else:
            held += len(out._seq.text) > len(out.text)
    assert len(finals) == len(prompts) and held  # some step held text back, so the check above was not idle
    assert any(o.finish_reason == "stop" for o in llm.generate(prompts, params))


def test_run_takes_the_batch_defaults_from_the_model():
    from infer.cli.batch_io import model_names
    from infer.engine.config import EngineConfig
    assert model_names(EngineConfig(model="tiny-llama")).sampling == (("temperature", 1.0),)


def test_a_half_decoded_character_is_no_stop_string():
    """A reply whose bytes end inside a character decodes with a trailing U+FFFD until the next token completes it:
    a stop string holding U+FFFD must not match there (it ended the reply at a character that was on its way)."""
    from infer import LLM, SamplingParams
    llm = LLM("tiny-llama")
    dec = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompt = llm.tokenizer("Hello")["input_ids"]
    for seed in (41, *range(41)):  # 41: the split the probe found (the built-in model is deterministic)
        params = dict(max_new_tokens=40, temperature=1.5, seed=seed, ignore_eos=True)
        ids = llm.generate([prompt], SamplingParams(**params))[0].token_ids
        split = [k for k in range(1, len(ids)) if dec(ids[:k]).endswith("\ufffd") and "\ufffd" not in dec(ids[:k + 1])]
        if split:
            break
    else:
        pytest.fail("no reply with a character split over two tokens")
    out = llm.generate([prompt], SamplingParams(**params, stop=["\ufffd"]))[0]
    k = split[0]  # the reply goes on past the split character (a later, real U+FFFD may end it)
    assert len(out.token_ids) > k + 1 and out.token_ids == ids[:len(out.token_ids)]
    assert out.text.startswith(dec(ids[:k + 1])) and "\ufffd" not in out.text


def test_an_adapter_folder_rewritten_while_registered_fails_its_requests(tmp_path):
    """Evicted from its slot and from the CPU copies, an adapter is read from its folder again. A folder rewritten
    with other weights was read silently while the prefix cache still held K/V of the old ones under its name: the
    reply matched neither adapter. Now such a request fails naming the folder; the other adapter still runs."""
    import shutil
    from infer import LLM, SamplingParams
    from infer.models.tiny import ensure_builtin
    from lora_helpers import hf_float, save_adapter
    base = ensure_builtin("tiny-llama")
    hf = hf_float(base)
    kw = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    old, new, other = (save_adapter(hf, tmp_path / n, seed=s, **kw) for n, s in (("old", 1), ("new", 2), ("b", 3)))
    live = tmp_path / "live"
    shutil.copytree(old, live)
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm = LLM(str(base), loras={"a": str(live), "b": str(other)}, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              block_size=4, max_model_len=64)
    prompt = list(range(5, 22))
    assert llm.generate([prompt], sp, lora="a")[0].error is None
    llm.generate([[7, 8, 9]], sp, lora="b")  # a leaves its slot and the CPU copies
    shutil.rmtree(live)
    shutil.copytree(new, live)
    out = llm.generate([prompt], sp, lora="a")[0]
    assert out.finish_reason == "error" and "changed since it was added" in out.error and str(live) in out.error
    assert llm.generate([[7, 8, 9]], sp, lora="b")[0].error is None
