"""Second round of hostile-user probes (session 5): adapters whose folder disappears after registration, the
Python API from two threads or with an abandoned stream, and other inputs found while probing; peft and
transformers are the oracles."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from typer.testing import CliRunner

from infer import LLM, SamplingParams
from infer.cli.main import app
from infer.models.tiny import ensure_builtin

from lora_helpers import ALL, PeftOracle, hf_float, save_adapter

runner = CliRunner()
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def base():
    return ensure_builtin("tiny-llama")


@pytest.fixture()
def adapters(base, tmp_path):
    """Two adapters with different target sets, in folders the test may delete; peft's oracle over both."""
    hf = hf_float(base)
    paths = {"a": save_adapter(hf, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules=ALL),
             "b": save_adapter(hf, tmp_path / "b", seed=2, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])}
    oracle = PeftOracle(hf, paths)
    yield paths, oracle
    oracle.close()


def _tight_llm(base, paths):
    """One device slot and one CPU copy: every other adapter is read from its folder again when it is used."""
    return LLM(str(base), loras={n: str(p) for n, p in paths.items()}, max_loras=1, max_cpu_loras=1,
               max_lora_rank=8, block_size=4, num_kv_blocks=64, max_model_len=64)


@pytest.mark.parametrize("change, message", [("delete", "folder not found"),
                                             ("rank 16", "rank 16 is larger than --max-lora-rank 8")])
def test_an_adapter_folder_deleted_or_changed_after_start_fails_only_its_requests(base, adapters, change, message):
    """The adapter was re-read from its (deleted or replaced) folder inside the scheduler: the LoRAError escaped
    step(), the whole generate() raised, the other requests' outputs were lost and its KV blocks leaked."""
    paths, oracle = adapters
    llm = _tight_llm(base, paths)
    free = llm.engine.block_manager.num_free_blocks
    shutil.rmtree(paths["a"])
    if change != "delete":
        save_adapter(hf_float(base), paths["a"], seed=9, r=16, lora_alpha=8, target_modules=ALL)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    outs = llm.generate(prompts, GREEDY, lora=["a", None, "b"])
    assert outs[0].finish_reason == "error" and message in outs[0].error and "'a'" in outs[0].error
    assert outs[1].token_ids == oracle.greedy(None, prompts[1], 4)
    assert outs[2].token_ids == oracle.greedy("b", prompts[2], 4)
    assert llm.engine.block_manager.num_free_blocks == free
    assert not llm.engine.has_unfinished_requests() and llm.engine.lora_manager.pins("b") == 0
    assert llm.generate([prompts[2]], GREEDY, lora="b")[0].token_ids == outs[2].token_ids  # still serving


def test_run_with_an_adapter_folder_deleted_mid_run_writes_an_error_record_for_its_lines(base, adapters,
                                                                                         tmp_path, monkeypatch):
    """`infer run` failed the wrong requests (those running) and lost the line whose adapter could not be read."""
    from infer.lora.manager import LoRAManager
    paths, oracle = adapters
    real = LoRAManager.register

    def register(self, name, path):  # the folder goes away right after the engine read it
        adapter = real(self, name, path)
        if name == "a":
            shutil.rmtree(path)
        return adapter
    monkeypatch.setattr(LoRAManager, "register", register)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [("x", [5, 6, 7], "b"), ("y", [8, 9, 10], "a"), ("z", [12, 13], None), ("w", [3, 4, 5], "b")]
    inp.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "lora": lo, "ignore_eos": True}) + "\n"
                           for i, p, lo in rows))
    args = ["run", str(base), str(inp), "-o", str(out), "--max-new-tokens", "4", "--max-num-seqs", "2",
            "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "8", "--max-model-len", "64",
            *(x for n, p in paths.items() for x in ("--lora", f"{n}={p}"))]
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "3 ok, 1 failed" in res.output, res.output
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(recs) == ["w", "x", "y", "z"]
    assert recs["y"]["finish_reason"] == "error" and "folder not found" in recs["y"]["error"]
    for rid, prompt, lora in rows:
        if rid != "y":
            assert recs[rid]["token_ids"] == oracle.greedy(lora, prompt, 4), rid


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", max_num_seqs=8, max_model_len=64) as llm:
        yield llm


def _hang_guarded(fn):
    """fn() in a daemon thread: a call that would wait forever fails the test instead of hanging it."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(120)  # a hang guard, not a timing
    assert box, "the call never returned"
    return box[0]


def _finished_alone(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_generate_from_two_threads_at_once_completes_both(llm):
    """Each call stepped the shared engine and dropped the outputs of the other call's requests, so the other
    thread waited forever for outputs already handed out (and add_request ran during another thread's step)."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 9)]
    prompts = [[[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [3, 4, 5]]]
    want = [_finished_alone(llm, p, sp) for p, sp in zip(prompts, params)]
    got: dict[int, list] = {}

    def work(i):
        for _ in range(3):
            got.setdefault(i, []).append([o.token_ids for o in llm.generate(prompts[i], params[i])])
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # a hang guard, not a timing
    assert not any(t.is_alive() for t in threads), "a thread never got its outputs"
    assert got == {0: [want[0]] * 3, 1: [want[1]] * 3}
    assert not llm.engine.has_unfinished_requests()


def test_a_paused_stream_survives_a_generate_in_between(llm):
    """generate() stepped the engine for the paused stream's requests and threw their outputs away: resuming the
    stream then waited forever for its last event."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = _finished_alone(llm, [[5, 6, 7]], params)[0]
    stream = llm.stream([[5, 6, 7]], params)
    first = next(stream)
    assert _finished_alone(llm, [[8, 9]], params) == _finished_alone(llm, [[8, 9]], params)
    events = [first, *_hang_guarded(lambda: list(stream))]
    assert events[-1][2].finished and events[-1][2].token_ids == want
    assert [t for _, _, o in events for t in o.new_token_ids] == want


def test_an_abandoned_stream_frees_its_requests_and_generate_still_works(llm):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    free = llm.engine.block_manager.num_free_blocks
    stream = llm.stream([[5, 6, 7], [8, 9]], params)
    next(stream)
    stream.close()
    assert len(llm.generate([[10, 11]], params)[0].token_ids) == 20
    assert llm.engine.block_manager.num_free_blocks == free and not llm.engine.has_unfinished_requests()
    assert not llm._mail  # no outputs kept for requests nobody reads


def test_a_closed_llm_says_so_with_an_infer_error():
    from infer.errors import InferError
    llm = LLM("tiny-llama", max_model_len=64)
    llm.close()
    llm.close()
    for call in (lambda: llm.generate("x"), lambda: next(llm.stream("x"))):
        with pytest.raises(InferError, match="closed") as info:
            call()
        assert isinstance(info.value, RuntimeError) and "new LLM" in str(info.value)


def test_a_very_large_batch_of_tiny_prompts(llm):
    prompts = [[3 + i % 50] for i in range(300)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
    assert [o.prompt_token_ids for o in outs] == prompts and all(len(o.token_ids) == 1 for o in outs)
    by_prompt = {}
    for o in outs:  # greedy: the same prompt gives the same token wherever it sits in the batch
        by_prompt.setdefault(o.prompt_token_ids[0], set()).add(o.token_ids[0])
    assert all(len(v) == 1 for v in by_prompt.values())


def test_lora_validate_on_a_file_says_it_is_a_file(base, tmp_path):
    """An adapter path that is a file (often adapter_model.safetensors itself) was reported as 'folder not found'."""
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(b"x")
    res = runner.invoke(app, ["lora-validate", str(base), f"a={weights}", "--steps", "0"])
    assert res.exit_code == 1 and "is a file, not a folder" in res.output and "adapter_config.json" in res.output
    assert "Traceback" not in res.output, res.output


def test_convert_merge_of_an_adapter_for_another_model_is_one_line(tmp_path):
    """An adapter with other shapes printed torch's whole load_state_dict report, one line per tensor."""
    other = ensure_builtin("tiny-qwen3")  # head_dim 32: q/k/v/o have other sizes than tiny-llama's
    adapter = save_adapter(hf_float(other), tmp_path / "qwen3-adapter", seed=1, r=4, lora_alpha=8,
                           target_modules=ALL)
    out = tmp_path / "merged"
    res = runner.invoke(app, ["convert", "tiny-llama", "-o", str(out), "--merge-lora", str(adapter)])
    assert res.exit_code == 2, res.output
    error = [line for line in res.output.splitlines() if line.startswith("error:")]
    # the check `--lora` makes: the first layer whose sizes differ, with the count of the rest, and a hint
    assert len(error) == 1 and "model.layers.0.self_attn." in error[0] and "base model's" in error[0], res.output
    assert "more problems" in error[0] and "hint:" in res.output, res.output
    assert "\tsize mismatch" not in res.output and "Traceback" not in res.output
    assert "warning:" not in res.output, res.output  # "its sizes may fit" beside an error saying they don't
    assert not out.exists()


def test_partial_layer_rank_one_and_full_rank_adapters_served_and_merged_match_peft(base, tmp_path):
    """Probe that already behaved: an adapter on layer 0 only (rank 1), one at rank == --max-lora-rank, the same
    folder under two names, mixed with base rows in one batch with one slot; and the partial adapter merged by
    `infer convert` gives peft's merged model's greedy tokens."""
    hf = hf_float(base)
    paths = {"part1": save_adapter(hf, tmp_path / "part1", seed=3, r=1, lora_alpha=2, target_modules=ALL,
                                   layers_to_transform=[0]),
             "full8": save_adapter(hf, tmp_path / "full8", seed=4, r=8, lora_alpha=16, target_modules=["o_proj"])}
    oracle = PeftOracle(hf, paths)
    llm = LLM(str(base), loras={**{n: str(p) for n, p in paths.items()}, "twin": str(paths["full8"])},
              max_loras=1, max_lora_rank=8, block_size=4, num_kv_blocks=64, max_model_len=64)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [5, 6, 7], [3, 4]]
    names = ["part1", None, "full8", "twin", "part1"]
    outs = llm.generate(prompts, GREEDY, lora=names)
    want = [oracle.greedy("full8" if n == "twin" else n, p, 4) for n, p in zip(names, prompts)]
    assert [o.token_ids for o in outs] == want
    assert want[0] != oracle.greedy(None, prompts[0], 4) or want[4] != oracle.greedy(None, prompts[4], 4)
    oracle.close()
    llm.close()
    merged = tmp_path / "merged"
    res = runner.invoke(app, ["convert", str(base), "-o", str(merged), "--merge-lora", str(paths["part1"])])
    assert res.exit_code == 0, res.output
    from peft import PeftModel
    peft_merged = PeftModel.from_pretrained(hf_float(base), str(paths["part1"])).merge_and_unload()
    with LLM(str(merged), max_model_len=64) as m:
        got = [o.token_ids for o in m.generate(prompts, GREEDY)]
    import torch
    with torch.no_grad():
        ref = [peft_merged.generate(input_ids=torch.tensor([p]), max_new_tokens=4, do_sample=False,
                                    pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == ref


@pytest.mark.parametrize("prompts, where", [([None], "prompt 0 is of type NoneType"), (["ok", 7], "prompt 1 is of type int"),
                                            ([[1, "a"]], "prompt 0 is a list whose items"),
                                            ([[True, False]], "prompt 0 is a list whose items")])
def test_llm_prompts_of_the_wrong_type_are_request_errors(llm, prompts, where):
    """None gave a bare TypeError; [True, False] ran as token ids 1 and 0; [1, "a"] was 'outside the vocabulary'."""
    from infer.errors import RequestError
    with pytest.raises(RequestError, match=where):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_llm_accepts_a_generator_of_prompts(llm):
    """A generator of prompts raised TypeError ('generator' object is not subscriptable)."""
    prompts = [[5, 6, 7], [8, 9]]
    assert [o.token_ids for o in llm.generate(p for p in prompts)] == [o.token_ids for o in llm.generate(prompts)]


def test_a_stream_of_an_llm_closed_meanwhile_ends_with_the_closed_error():
    from infer.errors import ClosedError
    llm = LLM("tiny-llama", max_model_len=64)
    stream = llm.stream([[5, 6, 7]], SamplingParams(max_new_tokens=10, ignore_eos=True))
    next(stream)
    llm.close()
    with pytest.raises(ClosedError, match="closed"):
        next(stream)



def test_a_request_the_engine_fails_on_ends_with_an_error_output_and_the_others_complete(llm, monkeypatch):
    """LLM.generate raised the step's exception and every other output of the call was lost; `infer run` and the
    server already failed only the running requests."""
    from infer.engine.model_runner import ModelRunner
    real = ModelRunner.run
    poison = [7, 7, 7, 7]
    monkeypatch.setattr(ModelRunner, "run", lambda self, batch: (_ for _ in ()).throw(RuntimeError("boom"))
                        if any(s.prompt_token_ids == poison for s in batch.seqs) else real(self, batch))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    want = _finished_alone(llm, [[5, 6], [8, 9]], params)
    llm.engine.scheduler.max_num_seqs = 1  # one request per step: only the poisoned one fails
    try:
        outs = llm.generate([[5, 6], poison, [8, 9]], params)
    finally:
        llm.engine.scheduler.max_num_seqs = 8
    assert [o.finish_reason for o in outs] == ["length", "error", "length"] and "boom" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == want
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("options, message", [
    (dict(loras={"a": None}), "--lora 'a': None is not a folder path"),
    (dict(loras="/no/such/adapter"), "is not NAME=PATH"),  # a string was read as a list of one-letter items
    (dict(max_loras="2"), "--max-loras must be an integer, got '2'"),
    (dict(max_num_seqs=2.5), "--max-num-seqs must be an integer, got 2.5"),
])
def test_llm_options_of_the_wrong_type_are_config_errors(options, message):
    """These raised TypeError from deep inside, or (a string of adapters) named the adapter '/'."""
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        LLM("tiny-llama", max_model_len=64, **options)
    assert "'/'" not in str(info.value)


def test_convert_warns_when_the_merged_adapter_names_another_base(base, tmp_path):
    """An adapter trained on tiny-llama3 (same sizes as tiny-llama) was merged into tiny-llama without a word;
    `infer lora-validate` warns about it, and now convert does too. An adapter of this base merges silently."""
    other = save_adapter(hf_float(ensure_builtin("tiny-llama3")), tmp_path / "l3", seed=1, r=2, lora_alpha=4,
                         target_modules=["q_proj"])
    own = save_adapter(hf_float(base), tmp_path / "own", seed=1, r=2, lora_alpha=4, target_modules=["q_proj"])
    res = runner.invoke(app, ["convert", "tiny-llama", "-o", str(tmp_path / "m1"), "--merge-lora", str(other)])
    assert res.exit_code == 0 and "warning: adapter 'l3' was trained on" in res.output, res.output
    res = runner.invoke(app, ["convert", "tiny-llama", "-o", str(tmp_path / "m2"), "--merge-lora", str(own)])
    assert res.exit_code == 0 and "warning" not in res.output, res.output
