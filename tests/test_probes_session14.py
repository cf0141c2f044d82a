"""Found by the fourteenth session's probes: completions top_logprobs without the sampled token, chat messages losing
their name and tool calls on the server (not through LLM.chat), numpy numbers refused or misread by the Python API,
a stop string matched inside a request's forced prefix, and a server's statistics counting its own warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from infer import LLM, SamplingParams
from infer.engine.inputs import encode_prompt
from infer.errors import RequestError
from infer.models.tiny import ensure_builtin
from infer.serve import protocol as p


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-qwen2", max_num_seqs=4, max_model_len=256) as llm:
        yield llm


class _Tok:
    def convert_ids_to_tokens(self, i):
        return f"t{i}"

    def decode(self, ids, **kw):
        return "".join(f"t{i}" for i in ids)


def test_completions_top_logprobs_always_hold_the_sampled_token():
    """A sampled token outside the top-k was missing from its position's dict, and logprobs: 0 gave null entries;
    OpenAI and vLLM put the sampled token in every entry (up to logprobs + 1 tokens)."""
    records = [{"token_id": 7, "logprob": -6.5, "top_logprobs": [{"token_id": 3, "logprob": -0.2}]},
               {"token_id": 3, "logprob": -0.1, "top_logprobs": [{"token_id": 3, "logprob": -0.1},
                                                                  {"token_id": 9, "logprob": -2.0}]},
               {"token_id": 5, "logprob": -1.0}]  # logprobs: 0
    lp = p.completion_logprobs(records, _Tok())
    assert lp["top_logprobs"] == [{"t7": -6.5, "t3": -0.2}, {"t3": -0.1, "t9": -2.0}, {"t5": -1.0}]
    assert list(lp["top_logprobs"][0]) == ["t7", "t3"]  # the sampled token first, as vLLM
    assert lp["tokens"] == ["t7", "t3", "t5"] and lp["token_logprobs"] == [-6.5, -0.1, -1.0]


TEMPLATE = ("{% for m in messages %}<|{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}|>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}{{ c.function.arguments | tojson }}</call>"
            "{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}<|assistant|>")

MESSAGES = [{"role": "user", "content": "weather?", "name": "alice"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_the_server_gives_the_template_every_field_of_a_message_as_llm_chat_does():
    """parse_chat rebuilt each message as {role, content}: a user's name and the earlier tool calls vanished from
    the prompt (200, no error), while LLM.chat and infer run kept them. Tool-call arguments sent as a JSON string
    (OpenAI's form) reach the template as the object, as in vLLM, not quoted twice."""
    tok = AutoTokenizer.from_pretrained(ensure_builtin("tiny-qwen2"))
    tok.chat_template = TEMPLATE
    original = repr(MESSAGES)
    req = p.parse_chat({"messages": MESSAGES}, tok)
    assert req.prompts == [encode_prompt(tok, messages=MESSAGES)]
    text = tok.decode(req.prompts[0])
    assert "<|user (alice)|>weather?" in text and "[c1]" in text
    assert '<call>get_weather{"city": "Paris"}</call>' in text, text
    assert repr(MESSAGES) == original  # the caller's messages are not changed
    with pytest.raises(p.ApiError, match="only text parts are supported") as e:
        p.parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, tok)
    assert e.value.status == 400 and e.value.param == "messages"


def test_numpy_numbers_are_numbers_and_token_ids(llm):
    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), max_new_tokens=np.int64(3),
                            seed=np.int32(1), stop_token_ids=[np.int64(5)], prefix_token_ids=[np.int16(7)])
    assert type(params.temperature) is float and type(params.max_new_tokens) is int
    assert params.stop_token_ids == [5] and type(params.prefix_token_ids[0]) is int
    with pytest.raises(RequestError, match="temperature must be a finite number"):
        SamplingParams(temperature=np.float32("nan"))
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = llm.generate([[1, 2, 3]], greedy)[0].token_ids
    # a list of numpy ints (list(array)) or of 0-d tensors is one prompt of token ids, not three prompts
    for prompt in ([np.int64(1), np.int64(2), np.int64(3)], list(torch.tensor([1, 2, 3]))):
        out = llm.generate(prompt, greedy)
        assert len(out) == 1 and out[0].prompt_token_ids == [1, 2, 3] and out[0].token_ids == want
    with pytest.raises(RequestError, match="prompt 0 is a list whose items are not all token ids"):
        llm.generate([[1, 2.5]], greedy)


def test_a_stop_string_is_not_searched_in_the_forced_prefix(llm):
    """stop=["ell"] with prefix_token_ids "Hello world" ended the request after one token with text 'H'."""
    prefix = llm.tokenizer("Hello world")["input_ids"]
    free = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6, ignore_eos=True, prefix_token_ids=prefix))[0]
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6, ignore_eos=True, prefix_token_ids=prefix,
                                                   stop=["ell"]))[0]
    assert free.text.startswith("Hello world")
    generated = free.text[len("Hello world"):]
    if "ell" in generated:  # the model itself wrote it: cut there, after the prefix
        assert out.text == "Hello world" + generated[:generated.index("ell")] and out.finish_reason == "stop"
    else:
        assert out.text == free.text and out.finish_reason == "length"


def test_a_warmed_up_engine_reports_no_steps_and_caches_no_warm_up_prompts():
    """A fresh server's /health said num_steps 6 and prefix_cache_hit_rate 0.35 before any request: the warm-up's
    made-up prompts were counted and stayed in the prefix cache."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig("tiny-llama", max_num_seqs=4, max_model_len=256, block_size=4))
    try:
        engine.warm_kernels()
        stats = engine.stats()
        assert stats["num_steps"] == 0 and stats["prefix_cache_hit_rate"] == 0.0 and stats["kv_blocks_used"] == 0
        assert engine.block_manager.hash_to_block == {}
        engine.add_request("a", list(range(1, 40)), SamplingParams(max_new_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats()["num_steps"] > 0
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------------- infer run
def _cli(*args):
    from typer.testing import CliRunner

    from infer.cli.main import app
    return CliRunner().invoke(app, ["run", "tiny-llama", *map(str, args), "-q"])


def _records(path):
    import json
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_broken_line_never_takes_the_id_of_a_later_line(tmp_path):
    """Broken line 2 took the id "2" (its line number), so the valid line with "id": 2 after it was refused as a
    duplicate, and the bad-JSON error was filed under the id 2."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 0, "prompt": "a", "max_new_tokens": 2}\n{"id": 1, "prompt": "b", "max_new_tokens": 2,}\n'
                   '{"id": 2, "prompt": "c", "max_new_tokens": 2}\n\xff\n')
    out = tmp_path / "out.jsonl"
    res = _cli(inp, "-o", out)
    assert res.exit_code == 1, res.output
    by_id = {r["id"]: r for r in _records(out)}
    assert set(by_id) == {"0", "line2", "2", "line4"}
    assert by_id["2"]["error"] is None and by_id["0"]["error"] is None
    assert by_id["line2"]["error"].startswith("line 2: bad JSON")
    assert "line 4" in by_id["line4"]["error"]


def test_resume_refuses_lines_appended_to_a_last_line_without_a_newline(tmp_path):
    """The appended request joined the old last line (already answered): resume ran nothing and exited 0."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "a", "max_new_tokens": 2}\n{"prompt": "b", "max_new_tokens": 2}')
    assert _cli(inp, "-o", out).exit_code == 0
    with open(inp, "a") as f:
        f.write('{"prompt": "c", "max_new_tokens": 2}\n')
    res = _cli(inp, "-o", out, "--resume")
    assert res.exit_code == 2 and "its old last line did not end with a newline" in res.output, res.output
    assert len(_records(out)) == 2
    inp.write_text('{"prompt": "a", "max_new_tokens": 2}\n{"prompt": "b", "max_new_tokens": 2}\n')
    out2 = tmp_path / "out2.jsonl"
    assert _cli(inp, "-o", out2).exit_code == 0
    with open(inp, "a") as f:  # lines of their own: the same input, grown
        f.write('{"prompt": "c", "max_new_tokens": 2}\n')
    res = _cli(inp, "-o", out2, "--resume")
    assert res.exit_code == 0, res.output
    assert [r["id"] for r in _records(out2)] == ["1", "2", "3"]


def test_max_completion_tokens_wins_over_max_tokens_wherever_each_comes(tmp_path):
    from infer.engine.inputs import params_from
    aliases = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
    for body in ({"max_completion_tokens": 4, "max_tokens": 8}, {"max_tokens": 8, "max_completion_tokens": 4}):
        assert params_from(body, aliases).max_new_tokens == 4
    assert params_from({"max_tokens": 8, "max_completion_tokens": None}, aliases).max_new_tokens == 8
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"custom_id": "b", "body": {"prompt": "hi", "max_completion_tokens": 3, "max_tokens": 8, '
                   '"ignore_eos": true}}\n')
    assert _cli(inp, "-o", out).exit_code == 0
    assert _records(out)[0]["usage"]["completion_tokens"] == 3


def test_an_input_without_requests_says_so_without_loading_a_model(tmp_path, monkeypatch):
    import infer.cli.run as run
    monkeypatch.setattr(run, "_run_in_process", lambda *a, **k: pytest.fail("a model was loaded for no request"))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    for content in (b"", b"\xef\xbb\xbf\n", b"\n  \r\n\t\n"):
        inp.write_bytes(content)
        out.write_text("stale\n")
        res = _cli(inp, "-o", out)
        assert res.exit_code == 0 and "holds no requests" in res.output, res.output
        assert out.read_bytes() == b""


def test_an_option_out_of_range_points_at_the_commands_own_help():
    from typer.testing import CliRunner

    from infer.cli.main import app
    for command in ("warmup", "bench"):
        res = CliRunner().invoke(app, [command, "tiny-llama", "--dtype", "float8"])
        assert res.exit_code == 2 and "is not one of auto, float32" in res.output, res.output
        assert f"see `infer {command} --help`" in res.output and "COMMAND" not in res.output, res.output


# ------------------------------------------------------------------------------------------------- infer serve
class _Handle:
    def __init__(self, calls):
        self.serve_step = type("M", (), {"remote": lambda _, *a: calls.append(a) or object()})()


def _ray_engine(replicas, max_num_seqs):
    from collections import deque
    from types import SimpleNamespace

    from infer.parallel.serve_engine import RayAsyncEngine
    eng = object.__new__(RayAsyncEngine)  # the driver's bookkeeping alone, without Ray
    eng.replicas, eng._adds, eng._calls = replicas, deque(), {}
    eng.engine = SimpleNamespace(config=SimpleNamespace(max_num_seqs=max_num_seqs))
    return eng


def test_data_parallel_queue_counts_only_requests_no_replica_can_start_and_idle_replicas_are_checked():
    """6 requests to 2 replicas of 2 slots with --max-queue 4 gave a 503 (2 would wait); a replica killed while idle
    stayed 'alive' until a request happened to reach it."""
    from infer.parallel.serve_engine import _Replica
    calls = []
    a, b, dead = (_Replica(i, _Handle(calls), {}) for i in range(3))
    dead.alive = False
    a.inflight = {f"a{i}": None for i in range(3)}
    b.inflight = {"b0": None}
    eng = _ray_engine([a, b, dead], max_num_seqs=2)
    eng._adds.extend([None, None])
    assert eng._would_wait() == 2  # 6 outstanding, 4 running slots on the live replicas
    b.calls = 1  # a step call of its own is on the way: no ping needed
    eng._ping()
    assert len(calls) == 1 and list(eng._calls.values()) == [a] and a.calls == 1 and calls[0] == ([], [])


def test_a_single_engines_queue_counts_only_requests_beyond_its_free_slots():
    from collections import deque
    from types import SimpleNamespace

    from infer.serve.async_engine import AsyncEngine
    eng = object.__new__(AsyncEngine)
    eng.engine = SimpleNamespace(config=SimpleNamespace(max_num_seqs=4))
    eng._adds, eng._num_waiting, eng._num_running = deque([None] * 3), 2, 1
    eng._held = deque()  # (requests held while generation is paused: none)
    assert eng._would_wait() == 2  # 5 to start, 3 free slots
    eng._num_running = 4
    assert eng._would_wait() == 5
    eng._held = deque([None] * 2)  # two held for POST /resume wait too
    assert eng._would_wait() == 7


def test_the_start_line_writes_an_ipv6_host_in_brackets():
    from infer.cli.serve import url_host
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1" and url_host("[::1]") == "[::1]"


def test_building_a_builtin_model_under_hf_hub_disable_progress_bars_prints_nothing(tmp_path):
    """The first `infer run` of a built-in model re-enabled transformers' progress bars after saving it, which under
    HF_HUB_DISABLE_PROGRESS_BARS=1 (a common setting, and what infer itself sets while hiding other libraries)
    printed huggingface_hub's 'Cannot enable progress bars' warning."""
    import os
    import subprocess
    import sys
    code = "from infer.models.tiny import ensure_builtin; ensure_builtin('tiny-llama')"
    env = {**os.environ, "INFER_CACHE": str(tmp_path), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "progress bars" not in res.stderr, res.stderr


# ------------------------------------------------------------------------------------ model preparation (probe 3)
def _invoke(*args):
    from typer.testing import CliRunner

    from infer.cli.main import app
    return CliRunner().invoke(app, list(map(str, args)))


def test_a_numbered_cuda_device_without_a_gpu_is_one_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    res = _invoke("warmup", "tiny-llama", "--max-length", "64", "--concurrency", "2", "--device", "cuda:1")
    assert res.exit_code == 2 and "--device cuda:1 was asked but no CUDA GPU is visible" in res.output, res.output


def test_a_cache_folder_that_cannot_be_written_is_one_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("INFER_CACHE", str(blocker))
    res = _invoke("warmup", "tiny-qwen3", "--estimate", "--max-length", "64", "--concurrency", "1")
    assert res.exit_code == 2 and "cannot write the built-in model 'tiny-qwen3'" in res.output, res.output
    assert "set INFER_CACHE to a folder you can write to" in res.output


def _float_copy(tmp_path, name="src"):
    import shutil
    src = tmp_path / name
    shutil.copytree(ensure_builtin("tiny-llama"), src)
    return src


def test_quantize_refuses_what_it_cannot_quantize_before_calibrating(tmp_path):
    """A truncated weight file and an AWQ checkpoint failed inside GPTQModel after calibration (with another
    error's words), and an AWQ folder with quantize_config.json was called 'already a GPTQ checkpoint'."""
    import json
    src = _float_copy(tmp_path)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    res = _invoke("quantize", src, "-o", tmp_path / "out", "--group-size", "32")
    assert res.exit_code == 2 and f"cannot read weight file {weights}" in res.output, res.output
    assert "the file is corrupted or truncated" in res.output and not (tmp_path / "out").exists()
    weights.write_bytes(data)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq", "bits": 4}}))
    (src / "quantize_config.json").write_text("{}")
    res = _invoke("quantize", src, "-o", tmp_path / "out", "--group-size", "32")
    assert res.exit_code == 2 and "is already quantized (quant_method 'awq')" in res.output, res.output
    (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (src / "quantize_config.json").unlink()
    res = _invoke("quantize", src, "-o", tmp_path / "out", "--group-size", "32")
    assert res.exit_code == 2 and "unsupported architecture" in res.output, res.output


def test_calibration_chats_may_hold_openai_text_parts(tmp_path):
    from infer.quant.calibration import _in_format, _jsonl_text
    line = '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hello "}, ' \
           '{"type": "text", "text": "there"}]}]}'
    assert _jsonl_text(line, tmp_path / "c.jsonl", 1, lambda msgs: _in_format(msgs, False)[0]["content"]) \
        == "hello \nthere"
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match="a content is a string or a list of text parts"):
        _jsonl_text('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', tmp_path / "c.jsonl", 1,
                    lambda msgs: "")


def test_warmup_estimate_refuses_a_quantization_the_engine_refuses(tmp_path):
    """--estimate said "fits" for an AWQ or 3-bit checkpoint that run and the measured warmup refuse (AWQ 'gemm' is
    read since session 53: its 'gemv' packing is not)."""
    import json
    src = _float_copy(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq", "bits": 4,
                                                                                "version": "gemv"}}))
    res = _invoke("warmup", src, "--estimate", "--max-length", "64", "--concurrency", "1")
    assert res.exit_code == 2 and "AWQ version 'gemv' is not supported" in res.output, res.output


def test_a_memory_limit_beyond_the_machine_is_refused():
    """--memory-limit 1TB on a 24 GiB machine planned 16,384 x 4,096 tokens and said "fits"."""
    import psutil
    res = _invoke("warmup", "tiny-llama", "--max-length", "4096", "--concurrency", "16384", "--estimate",
                  "--max-num-batched-tokens", "16384", "--memory-limit", f"{psutil.virtual_memory().total * 2}")
    assert res.exit_code == 2 and "is more than this machine's memory" in res.output, res.output


def test_sigterm_during_quantize_cleans_up_as_ctrl_c_does(tmp_path):
    """SIGTERM left the hidden staging folder beside -o and GPTQModel's offload copy in /tmp; it now stops as Ctrl-C
    does, says "terminated" and exits 143 (128 + SIGTERM)."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        import infer.quant.quantize as q
        from infer.quant.convert import staged_output
        def fake(src, out, options, calibration, observer, overwrite=False, check_weights=None, source_name=None):
            with staged_output(out, overwrite) as tmp:
                (tmp / "part.safetensors").write_bytes(b"x")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        q.quantize_model = fake
        from infer.cli.main import app
        app(["quantize", "tiny-llama", "-o", {str(tmp_path / "out")!r}], standalone_mode=True)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 143 and "terminated" in res.stderr, (res.returncode, res.stderr[-2000:])
    assert list(tmp_path.iterdir()) == []  # no output, no hidden staging folder


def test_hiding_other_libraries_leaves_the_environment_as_it_was(monkeypatch):
    """library_output set HF_HUB_DISABLE_PROGRESS_BARS and friends for good: after an in-process `infer bench` or
    `infer convert`, a later `infer --debug convert` in a child process lost transformers' loading bars."""
    import os

    from infer.cli.quiet import QUIET_ENV, library_output
    for k in QUIET_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TQDM_DISABLE", "0")  # the user's own setting stays as it is
    with library_output():
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and os.environ["TQDM_DISABLE"] == "0"
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ and os.environ["TQDM_DISABLE"] == "0"
