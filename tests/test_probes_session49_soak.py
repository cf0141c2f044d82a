"""Probes of the forty-ninth session's soak of the CLI, the server and the Python API by a newcomer and a hostile
user: each message names what the user sent and what to send instead."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("part, key", [({"type": "refusal", "text": "no"}, "refusal"),
                                       ({"type": "input_text", "refusal": "no"}, "text"),
                                       ({"type": "text", "text": 5}, "text")])
def test_a_text_part_without_its_key_names_the_key_its_kind_needs(part, key):
    """A refusal part ({"type": "refusal", "refusal": ...}) sent with "text" instead was told "every text part needs
    a string 'text'", which it had: the message now names the part's kind and the key that kind holds its text in."""
    from infer.engine.inputs import chat_messages
    from infer.errors import RequestError
    with pytest.raises(RequestError) as e:
        chat_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert e.value.message == f"messages[0].content: every {part['type']} part needs a string '{key}'", e.value.message
