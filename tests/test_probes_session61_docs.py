"""The README's /score and /rerank claims, run as written: /score reads one of vLLM's pairs of fields (text_1/text_2,
data_1/data_2, queries/documents, queries/items), so a field of another pair beside it is refused rather than ignored;
a deprecated spelling of use_activation that contradicts another is refused naming the field actually sent."""

from __future__ import annotations

import pytest

from test_probes_session60_classify import _post, _serve, build_classifier


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path, _ = build_classifier("tiny-qwen3", tmp_path_factory.mktemp("cls") / "ce", 1, seed=2)
    yield from _serve(path)


@pytest.mark.parametrize("extra", [{"text_1": "zzz"}, {"documents": ["zzz"]}, {"data_2": ["zzz"]}])
def test_score_refuses_a_field_of_another_pair(served, extra):
    """Before: `{"queries": "q", "documents": ["a"], "text_1": "zzz"}` scored q against a and dropped text_1."""
    pair = {"text_1": "q", "text_2": ["a"]} if "text_1" not in extra else {"queries": "q", "documents": ["a"]}
    code, out = _post(served, "/score", {**pair, **extra})
    field = next(iter(extra))
    assert code == 400, out
    assert out["error"]["param"] == field
    assert f"gives {field} beside" in out["error"]["message"] and "give one pair" in out["error"]["message"]
    code, alone = _post(served, "/score", pair)  # the pair alone still scores
    assert code == 200 and len(alone["data"]) == 1


@pytest.mark.parametrize("route,body", [("/score", {"text_1": "q", "text_2": "a"}),
                                        ("/rerank", {"query": "q", "documents": ["a"]})])
def test_contradicting_deprecated_spellings_name_the_fields_sent(served, route, body):
    code, out = _post(served, route, {**body, "softmax": True, "activation": False})
    assert code == 400, out
    assert out["error"]["message"].startswith("activation false contradicts softmax true"), out
    code, out = _post(served, route, {**body, "use_activation": False, "softmax": True})
    assert code == 400 and out["error"]["message"].startswith("softmax true contradicts use_activation false"), out
    code, agree = _post(served, route, {**body, "softmax": False, "activation": False})
    code2, plain = _post(served, route, {**body, "use_activation": False})
    assert code == code2 == 200 and agree["usage"] == plain["usage"]
    key = "data" if route == "/score" else "results"
    assert [d.get("score", d.get("relevance_score")) for d in agree[key]] == \
        [d.get("score", d.get("relevance_score")) for d in plain[key]]


def test_embedding_server_names_the_deprecated_spelling_it_refuses():
    """use_activation is refused on an embedding model (its score is a cosine); sent as softmax or activation, the
    error names that field, not use_activation, which the body does not hold."""
    gen = _serve("tiny-qwen3", runner="pooling")
    base = next(gen)
    try:
        got = {old: _post(base, "/score", {"text_1": "q", "text_2": ["a"], old: False})
               for old in ("use_activation", "softmax", "activation")}
        rerank = _post(base, "/rerank", {"query": "q", "documents": ["a"], "activation": True})
    finally:
        gen.close()
    for old, (code, out) in [*got.items(), ("activation", rerank)]:
        assert code == 400, out
        assert out["error"]["message"].startswith(f"{old} is a classifier's field"), out
        assert out["error"]["param"] == old
