"""Hostile-user probes (session 60) of what session 59 built: embeddings bodies, the MoE bench's flags, ... Each test
fails without its fix."""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers import served_tiny_llama


@pytest.fixture(scope="module")
def pooling_server():
    """tiny-llama as a pooling server (the model's default pooling: LAST, normalized): its base URL."""
    yield from served_tiny_llama(runner="pooling", max_num_seqs=4)


def _post(base: str, raw: bytes):
    import httpx
    r = httpx.post(base + "/v1/embeddings", content=raw, headers={"content-type": "application/json"}, timeout=60)
    return r.status_code, r.json()


@pytest.mark.parametrize("raw, message, param", [
    (b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests arrays/objects 5001 levels deep; the limit is 64", None),
    (b'{"input": NaN}', "input must be a finite number, got nan", "input"),
    (b'{"input": "hi", "dimensions": Infinity}', "dimensions must be a finite number", "dimensions"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages contains an unpaired surrogate", "messages"),
])
def test_an_embeddings_body_is_read_as_the_generation_routes_read_theirs(pooling_server, raw, message, param):
    """POST /v1/embeddings parsed its body with a bare json.loads: a body nested deeper than Python's recursion
    limit was a 500 ("internal server error: RecursionError") with a traceback in the log, and NaN / Infinity were
    read as numbers. It is read as /v1/completions reads its body now (--max-json-depth, every string valid Unicode,
    every number finite): a 400 naming the problem and the field."""
    status, reply = _post(pooling_server, raw)
    assert status == 400 and message in reply["error"]["message"], reply
    assert reply["error"]["param"] == param


@pytest.mark.parametrize("value", ["", {}, 0, False])
def test_an_encoding_format_of_no_name_is_refused(pooling_server, value):
    """encoding_format "" (or {}, 0, false: anything falsy) was read as float and answered 200 with floats; a
    client that meant base64 got a body it could not decode. Refused now, naming the field and the choices."""
    status, reply = _post(pooling_server, json.dumps({"input": "hi", "encoding_format": value}).encode())
    assert status == 400 and reply["error"]["param"] == "encoding_format", reply
    assert f"encoding_format {value!r} is not one of float, base64" in reply["error"]["message"]
    status, reply = _post(pooling_server, json.dumps({"input": "hi", "encoding_format": None}).encode())
    assert status == 200 and isinstance(reply["data"][0]["embedding"], list)  # (null: the default, float)


def test_the_chat_forms_add_generation_prompt_must_be_a_boolean(pooling_server):
    """The chat form's add_generation_prompt "yes" (or 1) was read as false silently (the embeddings route
    replaced it before the rendering's check); /v1/chat/completions refuses it. Refused now; true still opens the
    assistant's turn (more prompt tokens than the default, false)."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, reply = _post(pooling_server, json.dumps({**chat, "add_generation_prompt": "yes"}).encode())
    assert status == 400 and reply["error"]["param"] == "add_generation_prompt", reply
    assert "add_generation_prompt must be a boolean, got str" in reply["error"]["message"]
    counts = {}
    for add in (None, False, True):
        status, reply = _post(pooling_server, json.dumps({**chat, "add_generation_prompt": add}).encode())
        assert status == 200, reply
        counts[add] = reply["usage"]["prompt_tokens"]
    assert counts[None] == counts[False] < counts[True]


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "0"], "--group-size 0 must be at least 1"),
    (["--group-size", "-1"], "--group-size -1 must be at least 1"),
    (["--experts", "0"], "--experts 0 must be at least 1"),
    (["--top-k", "0"], "--top-k 0 must be at least 1"),
    (["--hidden", "0"], "--hidden 0 must be at least 1"),
    (["--intermediate", "100"], "--intermediate 100 is no multiple of 8 (int4 packs 8 values a word)"),
    (["--tune", "--top-k", "9", "--experts", "8"], "--top-k must be at most --experts"),
])
def test_the_moe_bench_refuses_bad_shapes_before_the_gpu(monkeypatch, capsys, argv, message):
    """`python -m infer.bench.moe --group-size 0` on a GPU ended in a ZeroDivisionError traceback; --group-size -1
    (GPTQ's per-channel), --experts 0, --top-k 0 or --hidden 0 in tracebacks from the random experts, after the GPU
    had started. Each is refused naming the flag before anything runs (on a CPU too), exit code 2."""
    from infer.bench.moe import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (what a GPU machine answers)

    def never():
        raise AssertionError("the bench ran")
    monkeypatch.setattr("infer.bench.kernels.copy_bandwidth", never)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("field, value, rule", [("logits_scaling", 0, "not 0"),
                                                ("residual_multiplier", float("nan"), ""),
                                                ("embedding_multiplier", float("inf"), ""),
                                                ("attention_multiplier", 0, "above 0"),
                                                ("attention_multiplier", -0.0625, "above 0")])
def test_granite_multipliers_no_model_has_are_refused_when_read(tmp_path, field, value, rule):
    """A Granite config.json with logits_scaling 0, a NaN multiplier or an attention_multiplier at or below 0
    loaded, and every request then failed at its first token with "the model's logits were not finite: the model
    overflowed (run it in bfloat16 or float32 with --dtype ...)", a hint that could not help (transformers' logits
    are not finite either). Refused when config.json is read, naming the field; tiny-granite's own scales load."""
    from infer import LLM, SamplingParams
    from infer.errors import ModelLoadError

    from helpers import tiny_llama_with_json
    path = tiny_llama_with_json(tmp_path / "granite", "config.json", base="tiny-granite", **{field: value})
    with pytest.raises(ModelLoadError, match=f"config.json has {field} {value!r}: Granite's {field} must be a "
                                             f"finite number{' ' + rule if rule else ''}"):
        LLM(str(path), max_model_len=64)
    fine = tiny_llama_with_json(tmp_path / "fine", "config.json", base="tiny-granite", logits_scaling=-4.0)
    out = LLM(str(fine), max_model_len=64).generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_a_too_long_text_among_many_inputs_is_named(pooling_server):
    """A body of many texts, one of them certainly longer than the context: the refusal said "the prompt is 5,000
    bytes long ..." without saying which of the inputs (a body of thousands: no way to find it), where a too-long
    list of token ids was named (input[2]: ...). Each is named now; a single input's refusal is as before."""
    long_text = "x" * 5000
    status, reply = _post(pooling_server, json.dumps({"input": ["hi", "there", long_text]}).encode())
    assert status == 400 and reply["error"]["param"] == "input", reply
    assert reply["error"]["message"].startswith("input[2]: the prompt is 5,000 bytes long"), reply
    status, reply = _post(pooling_server, json.dumps({"input": long_text}).encode())
    assert status == 400 and reply["error"]["message"].startswith("the prompt is 5,000 bytes long"), reply


@pytest.mark.parametrize("control", ["pause", "sleep"])
def test_an_embed_another_thread_ends_raises_naming_why(control):
    """LLM.embed while another thread's pause_generation(mode="abort") or sleep() ended its requests: embed returned
    a generation's RequestOutput for each (`.outputs` a list: `out.outputs.embedding` was an AttributeError in the
    caller's hands). It raises now, PauseError / SleepModeError naming how many ended and why; after the resume
    (the wake_up) the same embed gives the vectors of an uninterrupted one."""
    import threading

    from infer import LLM
    from infer.engine.sleep import PAUSED, SLEPT
    from infer.errors import PauseError, SleepModeError

    from helpers import wait_until
    from test_probes_session59_pause import _calling_mid_step
    prompts = [[(7 * i + k) % 500 for k in range(24)] for i in range(6)]
    with LLM("tiny-llama", runner="pooling", pooler_config={"pooling_type": "MEAN"}, block_size=4, max_model_len=64,
             max_num_batched_tokens=8, max_num_seqs=2, enable_sleep_mode=True) as llm:
        want = [o.outputs.embedding for o in llm.embed(prompts)]
        engine = llm.llm_engine
        seen = _calling_mid_step(engine, (lambda: engine.pause_generation(mode="abort")) if control == "pause"
                                 else (lambda: engine.sleep(level=1)))
        got: list = []

        def embed():
            try:
                got.append(llm.embed(prompts))
            except Exception as e:  # noqa: BLE001 - what the caller gets
                got.append(e)
        thread = threading.Thread(target=embed)
        thread.start()
        assert wait_until(lambda: "thread" in seen)
        seen["thread"].join(60)
        thread.join(60)
        error, why = (PauseError, PAUSED) if control == "pause" else (SleepModeError, SLEPT)
        assert isinstance(got[0], error), got
        assert f"of the 6 embeddings ended without their vector: {why}" in got[0].message
        engine.resume_generation() if control == "pause" else engine.wake_up()
        assert [o.outputs.embedding for o in llm.embed(prompts)] == want


def test_async_llm_encode_a_pause_ended_raises_naming_why():
    """AsyncLLM.encode whose request pause_generation(mode="abort") ended yielded a generation's RequestOutput
    (no `.outputs.embedding`); it raises PauseError naming it now, and after the resume gives the vector."""
    from infer.engine.sleep import PAUSED
    from infer.errors import PauseError

    from helpers import run_async_llm
    from test_probes_session59_pause import _calling_mid_step
    prompt = [(3 * k) % 500 for k in range(48)]

    async def main(llm):
        want = [out async for out in llm.encode(prompt, request_id="first")][-1].outputs.embedding
        engine = llm.engine
        seen = _calling_mid_step(engine, lambda: engine.pause_generation(mode="abort"))
        with pytest.raises(PauseError, match=re.escape(f"the embedding ended without its vector: {PAUSED}")):
            async for _ in llm.encode(prompt, request_id="paused"):
                pass
        seen["thread"].join(60)
        engine.resume_generation()
        assert [out async for out in llm.encode(prompt, request_id="again")][-1].outputs.embedding == want
    run_async_llm("tiny-llama", main, runner="pooling", pooler_config={"pooling_type": "MEAN"},
                  max_num_batched_tokens=8, max_num_seqs=2)
