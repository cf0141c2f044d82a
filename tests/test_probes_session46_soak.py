"""Session 46 soak probes: feature combinations run over time (fp8 KV cache, adapters, priority, n, beams, aborts,
resume, data parallel); each defect found is reproduced small here."""

from __future__ import annotations

import pytest

from infer.cli.resume import check_resume, write_fingerprint
from infer.errors import ConfigError


def test_resume_without_the_fp8_kv_cache_names_auto_not_none(tmp_path):
    """A run begun with --kv-cache-dtype fp8 and resumed without the option was refused with
    "kv_cache_dtype 'fp8_e4m3' -> None": the default (auto) is left out of OUT.resume.json, so the message showed
    None, which is no value of the option. It names auto, the value to pass or drop."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    out.write_text("")
    write_fingerprint(out, inp, {"model": "tiny-llama", "kv_cache_dtype": "fp8_e4m3"})
    with pytest.raises(ConfigError) as err:
        check_resume(out, inp, {"model": "tiny-llama"})
    assert "kv_cache_dtype 'fp8_e4m3' -> 'auto'" in err.value.message
    check_resume(out, inp, {"model": "tiny-llama", "kv_cache_dtype": "fp8_e4m3"})  # the same options: taken
    write_fingerprint(out, inp, {"model": "tiny-llama"})  # an auto run resumed with auto (the key left out both times)
    check_resume(out, inp, {"model": "tiny-llama"})
