"""Session 43 probes of adapters at run time (load/unload while requests run, slots, metrics, errors)."""

from __future__ import annotations

import re

import pytest

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine

from lora_helpers import three_adapters

pytest.importorskip("prometheus_client")

from infer.serve.metrics import ServerMetrics  # noqa: E402


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return three_adapters(tmp_path_factory.mktemp("lorart"), seed=43)[1]


def test_metrics_show_vllms_lora_requests_info_and_the_adapter_swaps(paths):
    """vLLM's /metrics has vllm:lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters}; a
    dashboard built for it found no infer:lora_* series at all, and the adapter swaps stats() counts were not shown."""
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8))
    try:
        for name in ("a", "b"):
            engine.add_lora(name, paths[name])
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        engine.add_request("1", {"prompt_token_ids": [5, 6, 7]}, params, lora="a")
        engine.add_request("2", {"prompt_token_ids": [8, 9]}, params, lora="b")  # waits: the one slot is a's
        engine.step()
        text = ServerMetrics(engine.stats, 128, "tiny-llama").render().decode()
        info = re.search(r"^infer:lora_requests_info\{(.*)\} (\S+)$", text, re.M)
        assert info is not None, text
        labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
        assert labels == {"max_lora": "1", "waiting_lora_adapters": "b", "running_lora_adapters": "a"}
        assert re.search(r'^infer:lora_swaps_total\{.*\} 1\.0$', text, re.M), text
        while engine.has_unfinished_requests():
            engine.step()
        text = ServerMetrics(engine.stats, 128, "tiny-llama").render().decode()
        assert 'waiting_lora_adapters=""' in text and 'running_lora_adapters=""' in text
        assert re.search(r'^infer:lora_swaps_total\{.*\} 2\.0$', text, re.M), text
    finally:
        engine.close()


def test_an_adapter_whose_folder_was_deleted_while_loaded_says_so_not_how_to_pass_lora(paths, tmp_path):
    """The CPU copy of 't' was dropped (--max-cpu-loras 1) and its folder deleted after it was added: its request
    failed with 'folder not found (pass --lora NAME=PATH with the folder save_pretrained wrote)', as if the name had
    been given a wrong path, to a client that loaded it fine (a server's /v1/load_lora_adapter took it with a 200)."""
    import shutil

    folder = shutil.copytree(paths["b"], tmp_path / "t")
    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, enable_lora=True, max_loras=1, max_cpu_loras=1,
                                    max_lora_rank=8))
    try:
        engine.add_lora("t", folder)
        engine.add_lora("u", paths["c"])  # the CPU copy of 't' is dropped
        shutil.rmtree(folder)
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        engine.add_request("1", {"prompt_token_ids": [5, 6, 7]}, params, lora="t")
        engine.add_request("2", {"prompt_token_ids": [5, 6, 7]}, params, lora="u")
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert outs["2"].finish_reason == "length"
        error = outs["1"].outputs[0].error
        assert outs["1"].finish_reason == "error" and str(folder) in error and "folder not found" in error
        assert "pass --lora" not in error and "when the adapter was added" in error and "--max-cpu-loras 1" in error
    finally:
        engine.close()


def test_a_refused_adapters_other_problem_is_counted_in_good_english_and_says_where_to_see_it(tmp_path):
    """A DoRA adapter (two problems: use_dora and its magnitude tensors) was refused with '(and 1 more problems)',
    naming neither the other problem nor where to read it."""
    from pathlib import Path

    from infer import LLM
    from infer.errors import LoRAError
    from infer.models.tiny import ensure_builtin

    from lora_helpers import hf_float, save_adapter
    dora = save_adapter(hf_float(Path(ensure_builtin("tiny-llama"))), tmp_path / "dora", seed=1, r=4, lora_alpha=8,
                        target_modules=["q_proj"], use_dora=True)
    with LLM("tiny-llama", enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64) as llm:
        with pytest.raises(LoRAError, match="DoRA") as err:
            llm.add_lora("dora", str(dora))
    assert "(and 1 more problem: `infer lora-validate` lists every one)" in str(err.value)


def test_removing_an_adapter_nobody_uses_neither_reads_its_folder_nor_drops_another_adapters_cpu_copy(paths, tmp_path):
    """--max-cpu-loras 1: 'y' holds the one CPU copy. Removing the unused 'x' read x's folder again (on the engine
    thread, holding up every step) and put it in the CPU LRU, which dropped y's copy: y's folder, gone since, was then
    needed and y's next request failed."""
    import shutil

    engine = LLMEngine(EngineConfig("tiny-llama", max_model_len=128, enable_lora=True, max_loras=1, max_cpu_loras=1,
                                    max_lora_rank=8))
    try:
        engine.add_lora("x", paths["a"])
        engine.add_lora("y", shutil.copytree(paths["b"], tmp_path / "y"))  # x's CPU copy is dropped
        reads = engine.lora_manager.disk_loads
        assert engine.remove_lora("x") == 0
        assert engine.lora_manager.disk_loads == reads and engine.list_loras() == ["y"]
        shutil.rmtree(tmp_path / "y")
        engine.add_request("1", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_new_tokens=3, ignore_eos=True),
                           lora="y")
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        assert [(o.finish_reason, o.outputs[0].error) for o in outs] == [("length", None)]
        assert not engine.lora_manager.retired()
    finally:
        engine.close()


def test_a_hub_id_as_a_runtime_adapters_path_says_nothing_is_downloaded_and_how_to_fetch_it(tmp_path, monkeypatch):
    """vLLM's /v1/load_lora_adapter (and LoRARequest) take a hub id as lora_path and download it; infer answered
    'folder not found (pass --lora NAME=PATH ...)', a CLI flag, to an HTTP client, not saying why nor what to do."""
    from infer import LLM
    from infer.errors import LoRAError

    monkeypatch.chdir(tmp_path)
    with LLM("tiny-llama", enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64) as llm:
        with pytest.raises(LoRAError, match="folder not found") as err:
            llm.add_lora("sql", "yard1/llama-2-7b-sql-lora-test")
        assert "nothing is downloaded" in str(err.value) and "--local-dir ./llama-2-7b-sql-lora-test" in str(err.value)
        assert "--lora" not in str(err.value)
        with pytest.raises(LoRAError, match="folder not found") as err:
            llm.add_lora("sql", "adapters/sql/v2")
        assert f"a relative path is read from {tmp_path}" in str(err.value) and "--lora" not in str(err.value)


def test_data_parallel_metrics_show_the_adapters_of_every_live_replica():
    """With --data-parallel, /metrics reads the replicas' summed stats: lora_requests_info must show the adapters
    waiting and running on any live replica (a dead one's are gone)."""
    from types import SimpleNamespace

    from infer.parallel.serve_engine import RayAsyncEngine, _Replica

    def stats(**kw):
        return {"num_running": 1, "num_waiting": 1, "kv_blocks_total": 10, "kv_blocks_used": 2, "lora_swaps": 2,
                "lora_max": 2, **kw}
    replicas = [_Replica(0, None, {}, stats=stats(lora_waiting=["b"], lora_running=["a"])),
                _Replica(1, None, {}, stats=stats(lora_waiting=["c"], lora_running=["a", "d"])),
                _Replica(2, None, {}, stats=stats(lora_waiting=["x"], lora_running=["y"]))]
    replicas[2].alive = False
    total = RayAsyncEngine._aggregate(SimpleNamespace(replicas=replicas))
    assert (total["lora_max"], total["lora_waiting"], total["lora_running"]) == (2, ["b", "c"], ["a", "d"])
    assert total["lora_swaps"] == 6  # a counter: the dead replica's swaps stay in it
    text = ServerMetrics(lambda: total, 128, "tiny-llama").render().decode()
    assert 'waiting_lora_adapters="b,c"' in text and 'running_lora_adapters="a,d"' in text
