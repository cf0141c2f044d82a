"""Structured outputs (vLLM's guided decoding: a JSON schema, any JSON object, a regex, a choice, an EBNF grammar)
against their oracle: transformers' `generate` on the same weights with xgrammar's own transformers logits
processor, greedy, token for token; in a batch that mixes kinds and unconstrained requests, with overlapped steps,
chunked prefill and preemption; sampled replies checked by Python's json and re; the row mask against xgrammar's
`apply_token_bitmask_inplace`; and every bad constraint refused with a message that names it, in Python, in
`infer run` lines (the other lines complete) and on the server (400 naming the field the client sent)."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from infer import LLM, SamplingParams, StructuredOutputsParams as S  # noqa: E402
from infer.engine.structured import apply_bitmask, choice_grammar  # noqa: E402
from infer.errors import RequestError  # noqa: E402

from helpers import hf_greedy, hf_model, infer_run_records, served_tiny_llama  # noqa: E402
from helpers import closing_llm as llm, tiny_llama_str as path  # noqa: E402, F401 (fixtures)

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"},
                                           "n": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
SPECS = {
    "json": S(json=SCHEMA, disable_any_whitespace=True),
    "json_text": S(json=json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 3})),
    "regex": S(regex="[a-c]{2,5}(-[0-9])?"),
    "choice": S(choice=["yes", "no", "maybe so"]),
    "grammar": S(grammar='root ::= "(" [a-z]+ ")" | "[" [0-9]* "]"'),
    "json_object": S(json_object=True),
}
PROMPTS = ["hello world", "the cat sat", "a b c d e"]
EOS = 2


@pytest.fixture(scope="module")
def compiler(path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf_model(path).config.vocab_size, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info), tok


def _compiled(compiler, spec: S):
    """The oracle's own compile of each kind, straight from xgrammar's API."""
    if spec.kind == "json":
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return compiler.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}')  # vLLM's json_object
    if spec.kind == "regex":
        return compiler.compile_regex(spec.regex)
    if spec.kind == "choice":
        return compiler.compile_grammar(" | ".join(f'"{c}"' for c in spec.choice).join(["root ::= ", ""]))
    return compiler.compile_grammar(spec.grammar)


def _hf_constrained(path, compiler, prompt: str, spec: S, n: int) -> list[int]:
    comp, tok = compiler
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model(path).generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                                      logits_processor=[xgr.contrib.hf.LogitsProcessor(_compiled(comp, spec))])
    return out[0, ids.shape[1]:].tolist()


def _requests():
    reqs = [(p, spec) for spec in SPECS.values() for p in PROMPTS]
    return reqs + [(PROMPTS[0], None), (PROMPTS[2], None)]  # unconstrained rows among them


def _check_equal(path, compiler, reqs, outs, n):
    tok = compiler[1]
    for (prompt, spec), out in zip(reqs, outs):
        if spec is None:
            assert out.token_ids == hf_greedy(path, tok(prompt)["input_ids"], n)[:len(out.token_ids)]
            continue
        want = _hf_constrained(path, compiler, prompt, spec, n)
        assert out.token_ids == want, (spec.kind, prompt, out.text)
        assert out.finish_reason == ("stop" if want[-1] == EOS else "length")


def test_greedy_tokens_equal_transformers_with_xgrammars_processor(path, llm, compiler):
    reqs = _requests()
    params = [SamplingParams(max_new_tokens=24, structured_outputs=spec) for _, spec in reqs]
    outs = llm.generate([p for p, _ in reqs], params)
    _check_equal(path, compiler, reqs, outs, 24)
    finished = {spec.kind for (_, spec), o in zip(reqs, outs) if spec is not None and o.finish_reason == "stop"}
    assert {"json", "regex", "choice"} <= finished  # the test reaches the grammars' ends, not only their starts
    for (_, spec), o in zip(reqs, outs):
        if spec is None or o.finish_reason != "stop":
            continue
        if spec.kind == "json":
            value = json.loads(o.text)
            assert set(value) >= {"a", "b"} and value["a"] in ("x", "yy") and isinstance(value["b"], bool)
        elif spec.kind == "regex":
            assert re.fullmatch(spec.regex, o.text)
        elif spec.kind == "choice":
            assert o.text in spec.choice


@pytest.mark.parametrize("engine", [dict(overlap=True), dict(overlap=True, max_num_batched_tokens=8, max_num_seqs=8),
                                    dict(overlap=True, num_kv_blocks=24, max_model_len=48, max_num_seqs=8)],
                         ids=["overlap", "chunked-prefill", "preemption"])
def test_the_same_tokens_with_overlap_chunked_prefill_and_preemption(path, compiler, engine):
    reqs = _requests()
    params = [SamplingParams(max_new_tokens=20, structured_outputs=spec) for _, spec in reqs]
    with LLM(path, block_size=4, **engine) as llm:
        outs = llm.generate([p for p, _ in reqs], params)
        preempted = llm.engine.scheduler.num_preemptions
    _check_equal(path, compiler, reqs, outs, 20)
    if "num_kv_blocks" in engine:
        assert preempted > 0


def test_sampled_replies_follow_the_constraint(llm):
    """Temperature 1.5 with seeds: whatever is drawn, a reply that ends (EOS) is what the constraint describes."""
    specs = [S(regex=r"(0|[1-9][0-9]{0,3})\.[0-9]{2}"), S(choice=['say "hi"', "back\\slash", "new\nline", "né"]),
             S(json={"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"],
                     "additionalProperties": False})]
    params = [SamplingParams(max_new_tokens=40, temperature=1.5, seed=s, structured_outputs=spec)
              for spec in specs for s in range(6)]
    outs = llm.generate(["go"] * len(params), params)
    ended = 0
    for p, o in zip(params, outs):
        spec = p.structured_outputs
        if o.finish_reason != "stop":
            continue
        ended += 1
        if spec.kind == "regex":
            assert re.fullmatch(spec.regex, o.text), o.text
        elif spec.kind == "choice":
            assert o.text in spec.choice, o.text
        else:
            assert json.loads(o.text)["k"] in (1, 2, 3)
    assert ended >= 12


def test_a_choice_with_quotes_backslashes_and_newlines_is_its_exact_string(compiler):
    comp, _ = compiler
    choices = ['say "hi"', "back\\slash", "new\nline", "tab\there", "né €"]
    compiled = comp.compile_grammar(choice_grammar(choices))
    for c in choices:  # each choice's text completes the grammar; a prefix does not; other text is refused
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(c[:-1]) and not m.is_completed()
        assert m.accept_string(c[-1]) and m.is_completed()
    for other in ("say hi", "back/slash", "new line", "nz"):
        assert not xgr.GrammarMatcher(compiled).accept_string(other)


@pytest.mark.parametrize("seed", range(3))
def test_the_row_mask_is_xgrammars_apply_token_bitmask(seed):
    g = torch.Generator().manual_seed(seed)
    n, vocab = 5, 77
    logits = torch.randn(n, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), generator=g,
                            dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([4, 0, 2])
    full = torch.zeros(n, bitmask.shape[1], dtype=torch.int32).index_copy(0, rows, bitmask)  # xgrammar's rows
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, full, indices=rows.tolist())
    assert torch.equal(apply_bitmask(logits, rows, bitmask), want)
    every = torch.randint(-2**31, 2**31 - 1, (n, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, every)
    assert torch.equal(apply_bitmask(logits, None, every), want)


@pytest.mark.parametrize("kwargs,message", [
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1, 2]), "must be a JSON schema (an object)"),
    (dict(regex="a", choice=["b"]), "exactly one of json, regex, choice, grammar, json_object (got regex, choice)"),
    (dict(), "exactly one of"),
    (dict(choice=[]), "choice must be a non-empty list of non-empty strings"),
    (dict(choice=["a", ""]), "non-empty strings"),
    (dict(grammar="  "), "grammar must be a non-empty string"),
    (dict(json_object="yes"), "json_object must be true"),
    (dict(regex="a", disable_any_whitespace="no"), "disable_any_whitespace must be true or false"),
])
def test_bad_constraints_are_refused_on_construction(kwargs, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        S(**kwargs)


@pytest.mark.parametrize("spec,message", [
    (S(json={"type": "foo"}), "the structured output's JSON schema does not compile: Unsupported type \"foo\""),
    (S(regex="(ab"), "the structured output's regex does not compile: Regex parsing error"),
    (S(grammar="root ::= foo"), "the structured output's grammar does not compile: EBNF parser error"),
])
def test_a_constraint_that_does_not_compile_is_a_request_error_and_others_run(llm, spec, message):
    with pytest.raises(RequestError, match=re.escape(message)) as e:
        llm.generate("hi", SamplingParams(max_new_tokens=3, structured_outputs=spec))
    assert "/project/" not in str(e.value) and "Check failed" not in str(e.value)  # no C++ source location
    out = llm.generate("hi", SamplingParams(max_new_tokens=3, structured_outputs=S(regex="[ab]+")))[0]
    assert re.fullmatch("[ab]+", out.text)


@pytest.mark.parametrize("extra,name", [(dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=2), "min_tokens"),
                                        (dict(allowed_token_ids=[5, 6]), "allowed_token_ids")])
def test_what_a_constraint_cannot_be_combined_with(extra, name):
    with pytest.raises(RequestError, match=f"structured_outputs cannot be combined with {name}"):
        SamplingParams(structured_outputs={"regex": "a+"}, **extra)


def test_the_fields_are_vllms_and_a_dict_works(llm):
    p = SamplingParams(max_new_tokens=8, structured_outputs={"choice": ["yes", "no"]})
    assert isinstance(p.structured_outputs, S) and p.structured_outputs.choice == ["yes", "no"]
    assert llm.generate("hi", p)[0].text in ("yes", "no")
    with pytest.raises(RequestError, match=r"unknown fields \['backend'\]"):
        SamplingParams(structured_outputs={"regex": "a", "backend": "outlines"})
    with pytest.raises(RequestError, match="guided_decoding.*infer spells it structured_outputs"):
        SamplingParams(guided_decoding={"regex": "a"})


def test_a_forced_prefix_is_part_of_the_reply_the_grammar_reads(llm, compiler):
    _, tok = compiler
    yes = tok("y", add_special_tokens=False)["input_ids"]
    out = llm.generate("hi", SamplingParams(max_new_tokens=8, prefix_token_ids=yes,
                                            structured_outputs=S(choice=["yes", "no"])))[0]
    assert out.text == "yes" and out.finish_reason == "stop"
    no = tok("x", add_special_tokens=False)["input_ids"]
    with pytest.raises(RequestError, match=r"prefix_token_ids\[0\] .* does not follow structured_outputs.choice"):
        llm.generate("hi", SamplingParams(prefix_token_ids=no, structured_outputs=S(choice=["yes", "no"])))


def test_without_xgrammar_the_error_says_what_to_install(path, monkeypatch):
    from infer.engine.structured import GrammarBackend
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    backend = GrammarBackend(object(), 64, [EOS])
    with pytest.raises(RequestError, match=r"need the xgrammar package.*pip install xgrammar"):
        backend.compile(S(regex="a"))


def test_infer_run_lines_native_and_openai_batch(tmp_path):
    lines = [
        {"id": "j", "prompt": "hi", "max_new_tokens": 30,
         "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"id": "bad", "prompt": "hi", "structured_outputs": {"regex": "(ab"}},
        {"custom_id": "rf", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}},
        {"custom_id": "gc", "body": {"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                     "guided_choice": ["yes", "no"]}},
        {"id": "plain", "prompt": "hi", "max_new_tokens": 3},
    ]
    recs, output = infer_run_records(tmp_path, lines)
    assert set(recs) == {"j", "bad", "rf", "gc", "plain"}, output
    assert "the structured output's regex does not compile" in recs["bad"]["error"]
    for key in ("j", "rf", "gc", "plain"):
        assert recs[key]["error"] is None
    assert json.loads(recs["j"]["text"])["a"] in ("x", "yy")
    assert recs["gc"]["text"] in ("yes", "no")


@pytest.fixture(scope="module")
def served():
    yield from served_tiny_llama()


def _post(base, path, body):
    import httpx
    return httpx.post(f"{base}{path}", json=body, timeout=120)


@pytest.mark.parametrize("field,value,spec", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}},
     S(json=SCHEMA)),
    ("response_format", {"type": "json_object"}, S(json_object=True)),
    ("guided_json", SCHEMA, S(json=SCHEMA)),
    ("guided_regex", "[a-c]{2,5}", S(regex="[a-c]{2,5}")),
    ("guided_choice", ["yes", "no", "maybe so"], S(choice=["yes", "no", "maybe so"])),
    ("guided_grammar", 'root ::= "(" [a-z]+ ")"', S(grammar='root ::= "(" [a-z]+ ")"')),
    ("structured_outputs", {"json": SCHEMA, "disable_any_whitespace": True}, S(json=SCHEMA,
                                                                                disable_any_whitespace=True)),
])
def test_the_servers_fields_give_the_python_apis_reply(served, llm, field, value, spec):
    """OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields: the same tokens as
    SamplingParams(structured_outputs=...) on an engine of the same model, streamed or not."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "temperature": 0, field: value,
            "return_token_ids": True}
    r = _post(served, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    want = llm.chat([{"role": "user", "content": "hi"}],
                    SamplingParams(max_new_tokens=24, structured_outputs=spec))[0]
    assert choice["token_ids"] == want.token_ids and choice["message"]["content"] == want.text
    import httpx
    with httpx.stream("POST", f"{served}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in s.iter_lines() if line.startswith("data: {") and '"choices":[{' in line)
    assert text == want.text


def test_the_openai_client_gets_json_that_parses(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x")
    reply = client.chat.completions.create(  # a random model writes whitespace for ever where JSON allows it
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content)["a"] in ("x", "yy")
    done = client.completions.create(model="tiny-llama", prompt="hi", max_tokens=8, temperature=0,
                                     extra_body={"guided_choice": ["yes", "no"]})
    assert done.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("extra,param,message", [
    ({"guided_regex": "(ab"}, "guided_regex", "the structured output's regex does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "foo"}}}},
     "response_format", "JSON schema does not compile: Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}}, "response_format",
     "response_format.json_schema needs a schema object"),
    ({"response_format": "json"}, "response_format", "response_format must be an object with a type"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice",
     "one structured output, got guided_json, guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "structured_outputs",
     "cannot be combined with ignore_eos"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "infer uses xgrammar"),
])
def test_bad_structured_fields_are_400_naming_the_field_and_the_server_goes_on(served, extra, param, message):
    r = _post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    ok = _post(served, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "temperature": 0,
                                           "guided_regex": "[0-9]+"})
    assert ok.status_code == 200 and re.fullmatch("[0-9]+", ok.json()["choices"][0]["text"])


def test_structured_steps_on_the_gpu_code_path_never_wait_and_never_guess(path, compiler, monkeypatch):
    """Under the sync audit (infer.bench.sync_audit; kernels through the Triton interpreter, overlapped steps): a
    step with constrained rows queues its bitmask as one more copy that does not wait, and no constrained row's
    mask is ever filled with its last token still on the device: a step whose constrained rows read a pending token
    is prepared and its forward queued, then the step before completes on the host and the mask is filled
    (SamplingInputs.settle), so steps keep overlapping while constrained requests run. The tokens are the
    oracle's."""
    if torch.cuda.is_available():
        pytest.skip("a GPU checks waits with sync debug mode")
    from infer import kernels
    from infer.bench.sync_audit import SyncAudit
    from infer.engine.sampler import SamplingInputs
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    filled, late = [], []  # each constrained row's tokens still on the device when its mask was filled
    real_init, real_settle = SamplingInputs.__init__, SamplingInputs.settle

    def init(self, seqs, *args, **kwargs):
        real_init(self, seqs, *args, **kwargs)
        late.append(self.late)
        if not self.late:
            filled.extend(s.num_pending for s in seqs if s.grammar is not None)

    def settle(self, *args):
        rows = self._late_rows
        filled.extend(s.num_pending for s in rows if s.grammar is not None)
        real_settle(self, *args)
    monkeypatch.setattr(SamplingInputs, "__init__", init)
    monkeypatch.setattr(SamplingInputs, "settle", settle)
    llm = LLM(path, block_size=4, overlap=True, max_num_seqs=8, max_model_len=64)
    eng, tok = llm.engine, compiler[1]
    reqs = [("hello world", SPECS["regex"]), ("the cat sat", SPECS["choice"]), ("a b c d e", None)]
    for i, (prompt, spec) in enumerate(reqs):
        eng.add_request(str(i), tok(prompt)["input_ids"], SamplingParams(max_new_tokens=10,
                                                                          structured_outputs=spec))
    outs, copies = {}, []
    with SyncAudit() as audit:
        while eng.has_unfinished_requests():
            before = len(audit.copies)
            steps = eng.num_steps
            for o in eng.step():
                outs[o.request_id] = o
            if eng.num_steps > steps:
                copies.append(len(audit.copies) - before)
    assert not audit.found, audit.report()
    assert max(copies) <= 3, copies
    assert len(filled) >= 4 and not any(filled), filled
    llm.close()
    for i, (prompt, spec) in enumerate(reqs):
        if spec is not None:
            assert outs[str(i)].token_ids == _hf_constrained(path, compiler, prompt, spec, 10)
        else:
            assert outs[str(i)].token_ids == hf_greedy(path, tok(prompt)["input_ids"], 10)
    assert sum(late) >= 3, late  # steps prepared while a constrained row's last token was on the device


def test_a_data_parallel_servers_driver_checks_the_constraint_before_it_travels(path):
    """`infer serve --data-parallel N` validates a request in the driver (ReplicaView, LLMEngine.validate) before a
    replica gets it: a constraint that does not compile is refused there, and a good one passes."""
    from transformers import AutoTokenizer
    from infer.engine.config import EngineConfig
    from infer.parallel.serve_engine import ReplicaView
    view = ReplicaView(EngineConfig(path, block_size=4), path, AutoTokenizer.from_pretrained(path),
                       {"max_model_len": 64, "vocab_size": 512, "num_blocks": 64, "adapters": []})
    view.validate([5, 6, 7], SamplingParams(max_new_tokens=4, structured_outputs=S(choice=["yes", "no"])))
    with pytest.raises(RequestError, match="the structured output's regex does not compile"):
        view.validate([5, 6, 7], SamplingParams(max_new_tokens=4, structured_outputs=S(regex="(ab")))


def test_a_tokenizer_xgrammar_cannot_read_is_a_request_error():
    from infer.engine.structured import GrammarBackend
    with pytest.raises(RequestError, match="structured outputs cannot read this model's tokenizer"):
        GrammarBackend(object(), 64, [EOS]).compile(S(regex="a"))


def test_the_benchmark_runs_both_sides(tmp_path):
    """`python -m infer.bench.structured` (its figures are in docs/perf.md): both sides make the same tokens."""
    from infer.bench import structured
    out = tmp_path / "rows.json"
    structured.main(["--concurrency", "3", "--tokens", "4", "--repeats", "1", "--vocab", "700", "--json", str(out)])
    rows = json.loads(out.read_text())
    engine, mask = rows
    assert engine["part"] == "engine" and engine["unconstrained_tok_s"] > 0 and engine["constrained_tok_s"] > 0
    assert mask["vocab"] == 700 and mask["fill_us_per_row"] > 0 and mask["fill_one_by_one_us_per_row"] > 0


def test_rows_filled_together_equal_rows_filled_one_by_one(compiler):
    """From BATCH_FILL_ROWS rows on the engine fills bitmasks on xgrammar's threads: the same bits as one by one."""
    from infer.engine.structured import BATCH_FILL_ROWS, fill_bitmask
    comp, tok = compiler
    matchers = []
    for i, text in enumerate(['{"a": "x', '{"a": "yy", "b": tr', '{', '{"a": "x", "b": false', '{"a"', '{"a": ']):
        m = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(SCHEMA)))
        assert m.accept_string(text)
        matchers.append(m)
    assert len(matchers) >= BATCH_FILL_ROWS
    together = fill_bitmask(matchers, 512, threads=True)
    assert torch.equal(fill_bitmask(matchers, 512, threads=False), together)
    for _ in range(12):  # the engine's own choice, whichever way it takes
        assert torch.equal(fill_bitmask(matchers, 512), together)
    for i, m in enumerate(matchers):
        assert torch.equal(together[i:i + 1], fill_bitmask([m], 512))
    assert len({tuple(row.tolist()) for row in together}) >= 4  # the states differ: the rows are not all alike


def test_fill_choice_keeps_the_way_this_host_fills_faster(monkeypatch):
    """The rows of a step are filled on xgrammar's threads or one by one, whichever this thread measured faster
    (on a 16-core H100 host the threads were 7x slower, on 2 cores 30% faster): each way PROBES times first, then
    the faster, and the slower again once every REPROBE fills; a fresh measurement can turn the choice."""
    from infer.engine import structured as st
    choice = st._FillChoice()
    cost = {True: 37e-6, False: 5e-6}  # per row: the H100 host's figures
    ways = []
    for _ in range(2 * st.PROBES + 2 * st.REPROBE):
        way = choice.threads()
        ways.append(way)
        choice.record(way, cost[way] * 64, 64)
    probes = ways[:2 * st.PROBES]
    assert probes.count(True) == probes.count(False) == st.PROBES
    after = ways[2 * st.PROBES:]
    assert after.count(True) == 2 and after.count(False) == len(after) - 2  # one re-probe per REPROBE fills
    assert after[st.REPROBE - 1] is True and after[2 * st.REPROBE - 1] is True
    cost = {True: 2e-6, False: 5e-6}  # the load changed: the threads are now faster
    for _ in range(st.PROBES * st.REPROBE):
        way = choice.threads()
        choice.record(way, cost[way] * 64, 64)
    assert choice.threads() is True


def test_fill_bitmask_takes_the_way_its_choice_names_and_times_it(compiler, monkeypatch):
    """fill_bitmask without `threads` asks this thread's _FillChoice for the vocabulary, fills that way, and records
    the time under that way; a forced way is neither asked nor recorded."""
    from infer.engine import structured as st
    comp, _ = compiler
    matchers = [xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(SCHEMA))) for _ in range(st.BATCH_FILL_ROWS)]
    used = []
    real_one = xgr.GrammarMatcher.fill_next_token_bitmask
    monkeypatch.setattr(xgr.GrammarMatcher, "fill_next_token_bitmask",
                        lambda self, *a, **k: used.append("one") or real_one(self, *a, **k))
    st._fillers.__dict__.pop("choices", None)
    for way in (True, False):
        used.clear()
        monkeypatch.setattr(st._FillChoice, "threads", lambda self, w=way: w)
        st.fill_bitmask(matchers, 512)
        assert used == ([] if way else ["one"] * len(matchers))
        assert len(st._fillers.choices[512].times[way]) == 1
    st.fill_bitmask(matchers, 512, threads=True)
    st.fill_bitmask(matchers[:2], 512)  # fewer rows than BATCH_FILL_ROWS: one by one, not timed
    assert [len(st._fillers.choices[512].times[w]) for w in (True, False)] == [1, 1]
