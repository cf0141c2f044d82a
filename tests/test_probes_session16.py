"""Fixes from the sixteenth session's probes (tokenization and streaming against transformers, the OpenAI server
against vLLM), each with the input that showed the bug."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.engine.detokenizer import Detokenizer
from infer.engine.sequence import Sequence, Status
from infer.models.tiny import ensure_builtin


@pytest.fixture(scope="module")
def llama2_style(tmp_path_factory):
    """tiny-llama's weights with a Llama-2-style tokenizer: SentencePiece-like (Metaspace, BPE over the built-in
    corpus) with byte fallback (<0x00>..<0xFF> tokens), and the decoder Replace, ByteFallback, Fuse, Strip."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import AutoTokenizer
    src = ensure_builtin("tiny-llama")
    dst = tmp_path_factory.mktemp("llama2") / "model"
    shutil.copytree(src, dst)
    from infer.models import tiny
    lines = (Path(tiny.__file__).parent / "data" / "corpus.txt").read_text().splitlines()  # shipped with infer
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=240, special_tokens=["<unk>", "<s>", "</s>"],
                                                      show_progress=False, limit_alphabet=60))
    d = json.loads(tok.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t, _ in sorted(d["model"]["vocab"].items(), key=lambda x: x[1]):
        vocab.setdefault(t, len(vocab))
    d["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True)
    d["added_tokens"] = [dict(id=i, content=c, single_word=False, lstrip=False, rstrip=False, normalized=False,
                              special=True) for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    d["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                    {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    (dst / "tokenizer.json").write_text(json.dumps(d, ensure_ascii=False))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token=None, tokenizer_class="LlamaTokenizer",
               clean_up_tokenization_spaces=False, add_bos_token=True, add_eos_token=False, legacy=False)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name in ("config.json", "generation_config.json"):
        c = json.loads((dst / name).read_text())
        c.update(bos_token_id=1, eos_token_id=2)
        c.pop("pad_token_id", None)
        (dst / name).write_text(json.dumps(c))
    return dst, AutoTokenizer.from_pretrained(str(dst))


def _stream(tok, ids):
    """Feed `ids` one at a time as the engine does; (the deltas handed out, the final text)."""
    seq, detok, deltas = Sequence("r", [1], SamplingParams(max_new_tokens=len(ids) + 1)), Detokenizer(tok), []
    for k, t in enumerate(ids):
        seq.output_token_ids.append(t)
        detok.update(seq, False)
        if k == len(ids) - 1:
            seq.status = Status.FINISHED
        deltas.append(Detokenizer.delta(seq))
    return deltas, seq.text


def test_streamed_text_of_byte_fallback_tokens_adds_up_to_the_final_text(llama2_style):
    """A SentencePiece byte-fallback decoder turns a run of byte tokens into UTF-8 as a whole, and every byte of a run
    that is not valid UTF-8 into U+FFFD: "\\n" (<0x0A>) followed by a lone 0xF0 becomes two U+FFFD. The deltas
    streamed "\\n" first, so they no longer added up to the final text. Text from an open run is now held back until
    a token that is not a byte (a special token does not end a run) or the end of the sequence."""
    _, tok = llama2_style
    assert type(tok.backend_tokenizer.decoder).__name__ == "Sequence" and tok.convert_tokens_to_ids("<0x0A>") == 13
    byte = lambda *xs: [tok.convert_tokens_to_ids(f"<0x{x:02X}>") for x in xs]  # noqa: E731
    the = tok.encode("the", add_special_tokens=False)
    deltas, text = _stream(tok, the + byte(0x0A, 0xF0, 0x9F))
    assert text == tok.decode(the + byte(0x0A, 0xF0, 0x9F), skip_special_tokens=True) == "the\ufffd\ufffd\ufffd"
    assert "".join(deltas) == text and deltas[1] == ""
    # a special token decodes to nothing, so the bytes on both sides of it are one run: "\n" waits for the 0xF0
    deltas, text = _stream(tok, the + byte(0x0A) + [tok.convert_tokens_to_ids("<s>")] + byte(0xF0))
    assert deltas == ["the", "", "", "\ufffd\ufffd"] and text == "the\ufffd\ufffd"
    deltas, text = _stream(tok, the + byte(0x0A) + the)  # a run that ends: its text goes out with the next token
    assert deltas == ["the", "", "\n the"] and text == "the\n the"
    rng = random.Random(0)
    pool = list(range(len(tok))) + list(range(3, 259)) * 2
    for _ in range(150):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        deltas, text = _stream(tok, ids)
        assert "".join(deltas) == text == tok.decode(ids, skip_special_tokens=True), ids


def test_llm_stream_adds_up_with_a_byte_fallback_tokenizer(llama2_style):
    path, tok = llama2_style
    llm = LLM(str(path), device="cpu", max_model_len=128)
    prompts = ["Hello 世界 😀", "The weather", "日本語"]
    got: dict[int, list[str]] = {}
    outs = {}
    for i, delta, out in llm.stream(prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)):
        got.setdefault(i, []).append(delta)
        if out.finished:
            outs[i] = out
    for i, out in outs.items():
        assert "".join(got[i]) == out.text == tok.decode(out.token_ids, skip_special_tokens=True)


# ---- chat content given as OpenAI text parts ----

from infer.engine.inputs import chat_messages, encode_prompt, reads_content_parts  # noqa: E402
from infer.errors import RequestError  # noqa: E402

PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
                  "{% else %}{% for part in m['content'] %}{% if part['type'] == 'text' %}[{{ part['text'] }}]"
                  "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(ensure_builtin("tiny-llama")))


def test_text_parts_are_joined_by_newlines_for_a_template_that_prints_content(tok):
    """vLLM joins the text parts with "\\n" for such a template (its "string" content format); infer joined them with
    nothing, so "Hello" + "world" reached the model as "Helloworld"."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert not reads_content_parts(tok)
    got = encode_prompt(tok, messages=[{"role": "user", "content": parts}])
    want = tok.apply_chat_template([{"role": "user", "content": "Hello\nworld"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    assert got == list(want)


def test_a_template_that_loops_over_the_parts_gets_them(tok, monkeypatch):
    """A template that loops over `message['content']` (vision and newer chat templates: vLLM's "openai" content
    format, found in the template's syntax tree as vLLM finds it) rendered an empty turn from the joined string:
    it looped over characters. It now gets the list, and renders what transformers renders from the messages vLLM
    gives it: string content is one text part there (session 39: it stayed a string)."""
    monkeypatch.setattr(tok, "chat_template", PARTS_TEMPLATE)
    assert reads_content_parts(tok)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    got = encode_prompt(tok, messages=messages)
    as_vllm = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}, messages[1]]
    want = tok.apply_chat_template(as_vllm, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert got == list(want)
    assert "[be brief]" in tok.decode(got) and "[Hello][world]" in tok.decode(got)


@pytest.mark.parametrize("template, reads", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    ("{% for m in messages %}{{ m.content | trim }}{% endfor %}", False),
    ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p['text'] }}{% endfor %}{% endfor %}",
     True),
    ("{% for m in messages %}{{ m['content'] }}", False),  # does not parse: the string form
])
def test_which_templates_read_content_parts(tok, monkeypatch, template, reads):
    monkeypatch.setattr(tok, "chat_template", template)
    assert reads_content_parts(tok) is reads


def test_an_assistant_refusal_part_is_its_text():
    """OpenAI's assistant content may hold a refusal part (vLLM reads it as text); infer refused the message."""
    msgs = chat_messages([{"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't"}]}])
    assert msgs[0]["content"] == "I can't"
    with pytest.raises(RequestError, match="every refusal part needs a string 'refusal'"):
        chat_messages([{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}])


# ---- the bench tokenizes a prompt as infer run and the server do ----

def test_bench_jsonl_prompts_keep_their_special_tokens(llama2_style, tmp_path):
    """A `{"prompt": ...}` line was tokenized without the BOS that `infer run` and the server add (a Llama-2-style
    tokenizer adds <s>), so the benchmark measured other prompts than a user sends."""
    from infer.bench.datasets import jsonl_requests
    _, tok = llama2_style
    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"prompt": "Hello world"}) + "\n")
    [req] = jsonl_requests(str(p), tok, 8)
    assert req.prompt_token_ids == encode_prompt(tok, prompt="Hello world") == tok("Hello world")["input_ids"]
    assert req.prompt_token_ids[0] == tok.bos_token_id == 1


# ---- a batch names the prompt that cannot be encoded ----

def test_a_prompt_that_cannot_be_encoded_is_named_by_its_index():
    llm = LLM(str(ensure_builtin("tiny-llama")), device="cpu", max_model_len=32)
    with pytest.raises(RequestError, match=r"^prompt 1: the prompt is 200,000 bytes long"):
        llm.generate(["hi", "x" * 200_000])
    with pytest.raises(RequestError, match=r"^prompt 2: messages\[0\]\.content has image_url parts"):
        llm.generate(["hi", "there", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]])
    with pytest.raises(RequestError, match=r"^the prompt is 200,000 bytes long"):  # one prompt: no index
        llm.generate("x" * 200_000)


# ---- the OpenAI server against vLLM's ----

@pytest.fixture(scope="module")
def server_url():
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(str(ensure_builtin("tiny-llama")), device="cpu", max_model_len=256,
                                    max_num_seqs=4))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base


def _post(url, path, body):
    import httpx
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _events(url, path, body):
    import httpx
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_seed_minus_one_is_no_seed(server_url):
    """vLLM's SamplingParams turns seed -1 into None (many clients send it for "random"); infer answered 400."""
    r = _post(server_url, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "seed": -1, "temperature": 1})
    assert r.status_code == 200, r.text
    assert SamplingParams(seed=-1).seed is None
    with pytest.raises(RequestError, match=r"seed must be in 0\.\.\d+, or -1 for none \(a random draw\), got -2"):
        SamplingParams(seed=-2)


def test_model_cards_carry_max_model_len(server_url):
    import httpx
    [card] = httpx.get(f"{server_url}/v1/models").json()["data"]
    assert card["max_model_len"] == 256 and card["id"] == "tiny-llama"


def test_stop_reason_names_the_stop_token_or_string(server_url):
    """vLLM's choices carry stop_reason: the stop token id or stop string that ended the choice (None for EOS or a
    length limit); infer's had no such field."""
    base = {"prompt": "the cat", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    plain = _post(server_url, "/v1/completions", base).json()["choices"][0]
    assert plain["finish_reason"] == "length" and plain["stop_reason"] is None
    tok_id = plain["token_ids"][3]
    by_token = _post(server_url, "/v1/completions", {**base, "stop_token_ids": [tok_id]}).json()["choices"][0]
    assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == tok_id
    stop = plain["text"][2:5]
    by_string = _post(server_url, "/v1/completions", {**base, "stop": ["zzz", stop]}).json()["choices"][0]
    assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == stop
    chat = _post(server_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
    assert chat["choices"][0]["stop_reason"] in (stop, None)  # the reply may differ; the field is there
    chunks = _events(server_url, "/v1/completions", {**base, "stream": True, "stop_token_ids": [tok_id]})
    assert [c["choices"][0]["stop_reason"] for c in chunks][-1] == tok_id
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])


def test_continuous_usage_stats_puts_usage_in_every_chunk(server_url):
    """stream_options.continuous_usage_stats (vLLM) was accepted and ignored, with any type."""
    body = {"prompt": "the cat", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _events(server_url, "/v1/completions", body)
    prompt_n = chunks[-1]["usage"]["prompt_tokens"]
    done = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert all(c["usage"]["prompt_tokens"] == prompt_n for c in chunks)
    assert done == sorted(done) and done[-1] == chunks[-1]["usage"]["completion_tokens"] == 5
    chat = _events(server_url, "/v1/chat/completions", {**{k: v for k, v in body.items() if k != "prompt"},
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert chat[0]["usage"]["completion_tokens"] == 0 and all(c["usage"] for c in chat)
    plain = _events(server_url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 5
    for options in ({"include_usage": True, "continuous_usage_stats": "yes"}, {"include_usage": True, "x": 1}):
        r = _post(server_url, "/v1/completions", {**body, "stream_options": options})
        assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"], r.text


# ---- infer run: made-up ids, files beside the output, resume ----

from typer.testing import CliRunner  # noqa: E402

from infer.cli.main import app  # noqa: E402

runner = CliRunner()


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(*args):
    return runner.invoke(app, ["run", "tiny-llama", *map(str, args), "--max-new-tokens", "3", "-q"])


@pytest.mark.parametrize("lines, want", [
    # a repeated id renamed x#line3 while line 1 already has that id: two records with one id, and --resume then
    # dropped line 1's answer for good
    (['{"id": "x#line3", "prompt": "legit one"}', '{"id": "x", "prompt": "a"}', '{"id": "x", "prompt": "b"}'],
     {"x#line3": "length", "x": "length", "x#line3~2": "error"}),
    # the renamed id of line 2 took a later line's own id, which was then refused as a duplicate
    (['{"id": "x", "prompt": "a"}', '{"id": "x", "prompt": "b"}', '{"id": "x#line2", "prompt": "c"}'],
     {"x": "length", "x#line2~2": "error", "x#line2": "length"}),
    # an unreadable line's made-up id took a later line's own id
    (['{"id": "a", "prompt": "a"}', '{bad', '{"id": "line2", "prompt": "legit"}'],
     {"a": "length", "line2~2": "error", "line2": "length"}),
])
def test_made_up_ids_are_no_other_lines_id_and_resume_keeps_every_record(tmp_path, lines, want):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    res = _run(inp, "-o", out)
    assert res.exit_code == 1, res.output
    got = {r["id"]: r["finish_reason"] for r in _records(out)}
    assert got == want and len(_records(out)) == 3
    res = _run(inp, "-o", out, "--resume")
    assert res.exit_code == 1, res.output  # the error record is still there: the run has a failed line
    assert {r["id"]: r["finish_reason"] for r in _records(out)} == want and len(_records(out)) == 3


def test_resume_over_error_records_exits_one(tmp_path):
    """A resumed run whose output holds error records from before exited 0 ("0 failed"): the same input run in one
    go exits 1."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "bad", "prompt": 5}\n{"id": "ok", "prompt": "hello"}\n')
    assert _run(inp, "-o", out).exit_code == 1
    out.write_text(out.read_text().splitlines()[0] + "\n")  # only the error record was written before a stop
    res = _run(inp, "-o", out, "--resume")
    assert res.exit_code == 1 and "holds 1 error record(s) from before this resume" in res.output, res.output
    assert sorted(r["id"] for r in _records(out)) == ["bad", "ok"]


@pytest.mark.parametrize("name", ["out.jsonl.tmp", "out.jsonl.resume.json"])
def test_an_input_named_like_a_file_beside_the_output_is_refused(tmp_path, name):
    """`infer run out.jsonl.resume.json -o out.jsonl` overwrote its own input with the resume record, and an input
    named out.jsonl.tmp was renamed over the output by --resume."""
    inp = tmp_path / name
    inp.write_text('{"prompt": "hello"}\n')
    res = _run(inp, "-o", tmp_path / "out.jsonl")
    assert res.exit_code == 2 and "a file infer run keeps beside -o" in res.output, res.output
    assert inp.read_text() == '{"prompt": "hello"}\n'


def test_missing_resume_record_is_said(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "hello"}\n')
    assert _run(inp, "-o", out).exit_code == 0
    (tmp_path / "out.jsonl.resume.json").unlink()
    res = _run(inp, "-o", out, "--resume")
    assert res.exit_code == 0 and "is missing, so infer cannot check" in res.output, res.output


def test_output_ending_with_a_slash_and_a_pipe_input_are_refused_before_the_model_loads(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hello"}\n')
    res = _run(inp, "-o", f"{tmp_path / 'newdir'}/")
    assert res.exit_code == 2 and "names a directory (it ends with a slash)" in res.output, res.output
    assert not (tmp_path / "newdir").exists()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    res = _run(fifo, "-o", tmp_path / "o.jsonl")
    assert res.exit_code == 2 and "is not a regular file (a pipe or a device?)" in res.output, res.output
