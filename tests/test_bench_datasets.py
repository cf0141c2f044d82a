"""Benchmark workloads: random, liteqwen, jsonl, sharegpt, LoRA mix."""

import json

import pytest

from infer.bench.datasets import (LITEQWEN, BenchRequest, assign_loras, liteqwen_output_len, load_workload,
                                  normal_token_ids)
from infer.errors import ConfigError


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from infer.models.tiny import ensure_builtin
    return AutoTokenizer.from_pretrained(ensure_builtin("tiny-llama"))


def test_random_exact_lengths_no_special_tokens_seeded(tok):
    wl = load_workload("random", tok, num_prompts=20, input_len=37, output_len=9, seed=3)
    special = set(tok.all_special_ids) | {tok.convert_tokens_to_ids("<|im_start|>")}
    assert len(wl.requests) == 20
    for r in wl.requests:
        assert len(r.prompt_token_ids) == 37 and r.output_len == 9 and r.ignore_eos
        assert not special & set(r.prompt_token_ids)
        assert r.prompt == tok.decode(r.prompt_token_ids)
    again = load_workload("random", tok, num_prompts=20, input_len=37, output_len=9, seed=3)
    other = load_workload("random", tok, num_prompts=20, input_len=37, output_len=9, seed=4)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in wl.requests]
    assert [r.prompt_token_ids for r in other.requests] != [r.prompt_token_ids for r in wl.requests]


def test_random_range_ratio_draws_uneven_lengths_in_range_seeded(tok):
    """vLLM's --random-range-ratio: each request's lengths uniform in [len x (1 - r), len x (1 + r)]; ratio 0 keeps
    the exact lengths and the very same prompts."""
    wl = load_workload("random", tok, num_prompts=200, input_len=40, output_len=10, seed=3, range_ratio=0.5)
    ins = [len(r.prompt_token_ids) for r in wl.requests]
    outs = [r.output_len for r in wl.requests]
    assert min(ins) == 20 and max(ins) == 60 and len(set(ins)) > 30  # both ends reached, spread between
    assert min(outs) == 5 and max(outs) == 15 and len(set(outs)) == 11
    assert "20-60 tokens" in wl.description and "5-15 output tokens" in wl.description
    again = load_workload("random", tok, num_prompts=200, input_len=40, output_len=10, seed=3, range_ratio=0.5)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in wl.requests]
    assert [r.output_len for r in again.requests] == outs
    exact = load_workload("random", tok, num_prompts=5, input_len=37, output_len=9, seed=3)
    zero = load_workload("random", tok, num_prompts=5, input_len=37, output_len=9, seed=3, range_ratio=0.0)
    assert [r.prompt_token_ids for r in zero.requests] == [r.prompt_token_ids for r in exact.requests]
    short = load_workload("random", tok, num_prompts=50, input_len=1, output_len=2, seed=0, range_ratio=0.9)
    assert all(len(r.prompt_token_ids) == 1 and 1 <= r.output_len <= 3 for r in short.requests)


@pytest.mark.parametrize("ratio", [1.0, -0.1, 2.0])
def test_random_range_ratio_out_of_range(tok, ratio):
    with pytest.raises(ConfigError, match=r"range ratio must be in \[0, 1\)"):
        load_workload("random", tok, num_prompts=2, input_len=8, output_len=8, range_ratio=ratio)


def test_range_ratio_only_for_random(tok, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n')
    with pytest.raises(ConfigError, match="applies to the random dataset"):
        load_workload(f"jsonl:{path}", tok, range_ratio=0.5)


def test_normal_token_ids_excludes_exactly_the_specials(tok):
    ids = set(normal_token_ids(tok).tolist())
    from infer.models.tiny import SPECIAL_TOKENS
    specials = set(tok.convert_tokens_to_ids(SPECIAL_TOKENS))  # <|im_start|> is special but not in all_special_ids
    assert ids == set(range(len(tok))) - specials and len(specials) == 3


def test_liteqwen(tok):
    wl = load_workload("liteqwen", tok)
    assert wl.concurrency == 16 and len(wl.requests) == 80
    n = liteqwen_output_len(tok)
    text = open(__import__("infer").__path__[0] + "/models/data/corpus.txt").read()
    chars_per_token = len(text) / len(tok.encode(text, add_special_tokens=False))
    assert abs(n * chars_per_token - LITEQWEN["reply_chars"]) <= chars_per_token
    for r in wl.requests:
        assert r.prompt_len == 44 and r.output_len == n and r.max_length == 4096 and r.lora is None


def test_jsonl(tok, tmp_path):
    p = tmp_path / "w.jsonl"
    lines = [{"prompt": "The weather today"}, {"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 5},
             {"prompt": "x", "max_tokens": 3, "lora": "a", "ignore_eos": True}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_workload(f"jsonl:{p}", tok, output_len=17).requests
    assert [r.output_len for r in reqs] == [17, 5, 3]
    assert reqs[0].prompt_token_ids == tok.encode("The weather today", add_special_tokens=False)
    assert reqs[1].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert reqs[2].lora == "a" and reqs[2].ignore_eos and not reqs[0].ignore_eos
    assert len(load_workload(f"jsonl:{p}", tok, num_prompts=2).requests) == 2


@pytest.mark.parametrize("bad", ['{"prompt": "ok"}\nnot json', '{"prompt": "ok"}\n{"nothing": 1}',
                                 '{"prompt": "ok"}\n{"prompt": "a", "max_new_tokens": 0}', '{"prompt": "ok"}\n[1]'])
def test_jsonl_bad_line_names_line_number(tok, tmp_path, bad):
    p = tmp_path / "bad.jsonl"
    p.write_text(bad)
    with pytest.raises(ConfigError, match="line 2"):
        load_workload(f"jsonl:{p}", tok)


def test_missing_file_and_unknown_spec(tok, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_workload(f"jsonl:{tmp_path}/nope.jsonl", tok)
    with pytest.raises(ConfigError, match="unknown workload"):
        load_workload("burst", tok)


def test_sharegpt(tok, tmp_path):
    long = "To cook rice, rinse it under cold water until the water runs clear"
    data = [
        {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long + " and simmer"}]},
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": long + " twice"},
                           {"from": "gpt", "value": long}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]},  # too short
        {"conversations": [{"from": "human", "value": long}]},  # no reply
        {"id": "no conversations"},
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    reqs = load_workload(f"sharegpt:{p}", tok, num_prompts=10, seed=0).requests
    assert len(reqs) == 2
    by_prompt = {r.prompt: r for r in reqs}
    r = by_prompt[long]
    assert r.output_len == len(tok.encode(long + " and simmer", add_special_tokens=False))
    assert r.prompt_token_ids == tok.encode(long, add_special_tokens=False)
    assert long + " twice" in by_prompt
    assert len(load_workload(f"sharegpt:{p}", tok, num_prompts=1).requests) == 1
    p.write_text("{broken")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_workload(f"sharegpt:{p}", tok)


def test_ignore_eos_override_and_lora_mix(tok):
    wl = load_workload("random", tok, num_prompts=5, input_len=4, output_len=2, ignore_eos=False)
    assert not any(r.ignore_eos for r in wl.requests)
    reqs = [BenchRequest("p", [1], 1) for _ in range(5)]
    assert [r.lora for r in assign_loras(reqs, ["a", "b"])] == ["a", "b", "a", "b", "a"]
    assert [r.lora for r in assign_loras(reqs, ["a", "b"], include_base=True)] == ["a", "b", None, "a", "b"]
    assert [r.lora for r in assign_loras(reqs, [])] == [None] * 5


def test_files_with_a_byte_order_mark_load(tok, tmp_path):
    """A UTF-8 BOM (what Windows editors write) is not part of the JSON, as `infer run` reads its input."""
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "The weather today"}).encode() + b"\n")
    [r] = load_workload(f"jsonl:{p}", tok).requests
    assert r.prompt == "The weather today"
    long = "To cook rice, rinse it under cold water until the water runs clear"
    p = tmp_path / "bom.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"conversations": [{"from": "human", "value": long},
                                                                   {"from": "gpt", "value": long}]}]).encode())
    [r] = load_workload(f"sharegpt:{p}", tok).requests
    assert r.prompt == long


def test_jsonl_messages_with_openai_text_parts(tok, tmp_path):
    """A content given as OpenAI text parts is joined by newlines, as `infer run` (and vLLM) read it, not rendered as
    the list's Python repr; other parts are refused, naming the line."""
    p = tmp_path / "parts.jsonl"
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": " world"}]
    p.write_text(json.dumps({"messages": [{"role": "user", "content": parts}]}) + "\n")
    [r] = load_workload(f"jsonl:{p}", tok).requests
    assert r.prompt == "<|im_start|>user\nhello\n world<|im_end|>\n<|im_start|>assistant\n"
    assert r.prompt_token_ids == tok.encode(r.prompt, add_special_tokens=False)
    p.write_text('{"prompt": "ok"}\n' + json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x.png"}}]}]}) + "\n")
    with pytest.raises(ConfigError, match=r"line 2: messages\[0\].content has image_url parts; only text parts"):
        load_workload(f"jsonl:{p}", tok)
    p.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}) + "\n")
    with pytest.raises(ConfigError, match="line 1: messages\\[0\\].content: every text part needs a string 'text'"):
        load_workload(f"jsonl:{p}", tok)


@pytest.mark.parametrize("line, field", [('{"prompt": "a\\ud800"}', "prompt"),
                                         ('{"messages": [{"role": "user", "content": "\\udc00b"}]}', "messages")])
def test_jsonl_lone_surrogate_is_refused_as_infer_run_refuses_it(tok, tmp_path, line, field):
    """JSON can escape a lone surrogate, which no tokenizer encodes: a prompt's used to crash with a TypeError."""
    p = tmp_path / "s.jsonl"
    p.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=rf"line 2: {field} contains an unpaired surrogate \(U\+D[8C]00\)"):
        load_workload(f"jsonl:{p}", tok)


@pytest.mark.parametrize("turn", ["human", "gpt"])
def test_sharegpt_lone_surrogate_names_the_item(tok, tmp_path, turn):
    long = "To cook rice, rinse it under cold water until the water runs clear"
    bad = {"from": turn, "value": long + " \ud800"}
    conv = [bad if turn == "human" else {"from": "human", "value": long},
            bad if turn == "gpt" else {"from": "gpt", "value": long}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([{"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": long}]},
                             {"conversations": conv}]))
    with pytest.raises(ConfigError, match=r"item 1: the conversation contains an unpaired surrogate \(U\+D800\)"):
        load_workload(f"sharegpt:{p}", tok)


@pytest.mark.parametrize("value", ['"false"', "1", "0", '"true"'])
def test_jsonl_ignore_eos_must_be_a_boolean(tok, tmp_path, value):
    """"false" (a string) used to count as true."""
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "ok", "ignore_eos": false}\n{"prompt": "x", "ignore_eos": ' + value + "}\n")
    with pytest.raises(ConfigError, match=r"line 2: ignore_eos must be true or false"):
        load_workload(f"jsonl:{p}", tok)
    p.write_text('{"prompt": "ok", "ignore_eos": null}\n{"prompt": "x", "ignore_eos": true, "id": "a"}\n')
    assert [r.ignore_eos for r in load_workload(f"jsonl:{p}", tok).requests] == [False, True]


def test_jsonl_unknown_field_is_named_with_the_accepted_ones(tok, tmp_path):
    """A misspelled field (output_len for max_new_tokens) used to be ignored silently, as `infer run` refuses it."""
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "ok"}\n{"prompt": "x", "output_len": 5, "temperature": 0.5}\n')
    with pytest.raises(ConfigError, match=r"line 2: unknown field\(s\) \['output_len', 'temperature'\]") as e:
        load_workload(f"jsonl:{p}", tok)
    assert "max_new_tokens" in e.value.hint and "ignore_eos" in e.value.hint
