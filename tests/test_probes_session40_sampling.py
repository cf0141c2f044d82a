"""Session 40 probes of sampling parameters and logprobs (vLLM's and OpenAI's semantics)."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.errors import RequestError


@pytest.mark.parametrize("key", [True, False])
def test_logit_bias_refuses_a_bool_key(key):
    """{True: 5.0} passed as token 1 (a bool is an int to isinstance), where every other token id field refuses it."""
    with pytest.raises(RequestError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={key: 5.0})
