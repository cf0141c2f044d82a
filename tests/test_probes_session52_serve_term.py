"""SIGTERM while `infer serve` loads its model (docker stop, a job scheduler's timeout): the process died by the
signal without a word (exit -15), where `infer run`, quantize and convert say "terminated" and exit 143."""

from __future__ import annotations

import os
import signal

import pytest
from typer.testing import CliRunner

from infer.cli.main import app


class _NoHandler(Exception):
    pass


def test_sigterm_while_the_model_loads_says_terminated_and_exits_143(monkeypatch):
    def previous(signum, frame):  # what ran without serve's own handler (instead of killing the test process)
        raise _NoHandler("SIGTERM reached the process's previous handler")

    class Loading:
        def __init__(self, cfg):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the engine is being built
            for _ in range(1000):
                pass
            raise AssertionError("SIGTERM did not stop the model's load")

    before = signal.signal(signal.SIGTERM, previous)
    try:
        monkeypatch.setattr("infer.engine.llm_engine.LLMEngine", Loading)
        result = CliRunner().invoke(app, ["serve", "tiny-llama", "--port", "0", "--device", "cpu"])
        assert not isinstance(result.exception, _NoHandler), "serve let SIGTERM end it without a word"
        assert result.exit_code == 143, (result.exit_code, result.output, result.exception)
        assert "terminated" in result.output
        assert signal.getsignal(signal.SIGTERM) is previous  # given back once the load is over
    finally:
        signal.signal(signal.SIGTERM, before)
