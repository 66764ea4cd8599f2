"""The splice of stored histories is sound: property check of the incremental validator against
json.loads."""

from __future__ import annotations

import json
import random

import pytest

from rollout_buffer.core.items import History as _History
from rollout_buffer.core.items import Malformed, uid

NOISE = [
    b" ",
    b"\t",
    b"\n",
    b"\r",
    b"\x0c",
    b"\x0b",
    b",",
    b"]",
    b"[",
    b"}",
    b"{",
    b'"',
    b"NaN",
    b"Infinity",
    b"1",
    b"-",
    b"e5",
    b"null",
    b"\xff",
    b"\xc3",
    "é".encode(),
    b"\\",
    b"x",
]


def reference(text: bytes):
    """What json.loads says: the list, or None when the text is not a JSON list (NaN refused)."""

    def no_constants(name):
        raise ValueError(name)

    try:
        value = json.loads(text.decode("utf-8"), parse_constant=no_constants)
    except ValueError:
        return None
    return value if isinstance(value, list) else None


def mutate(rng: random.Random, text: bytes, start: int = 0) -> bytes:
    """Insert or delete a byte or token, mostly in the new tail (after ``start``), where only the
    incremental check looks."""
    for _ in range(rng.choice([1, 1, 2])):
        i = rng.randrange(min(start, len(text)), len(text) + 1)
        if rng.random() < 0.3 and len(text) > 1:
            text = text[:i] + text[i + 1 :]
        else:
            text = text[:i] + rng.choice(NOISE) + text[i:]
    return text


def element(rng: random.Random, n: int) -> dict:
    return {
        "role": rng.choice(["user", "assistant"]),
        "content": f"turn {n} " + rng.choice(["é", '"q"', "\n", "x" * 20]),
    }


@pytest.mark.parametrize("seed", range(40))
def test_incremental_validation_agrees_with_json_loads(seed):
    rng = random.Random(seed)
    for _ in range(20):  # sessions
        history = _History()
        items: list = []
        sep = rng.choice([", ", ",", " ,\n "])
        for _step in range(rng.randint(1, 8)):
            for _ in range(rng.choice([0, 1, 2])):
                items.append(element(rng, len(items)))
            text = (
                "["
                + rng.choice(["", " ", "\n"])
                + sep.join(json.dumps(i, ensure_ascii=rng.random() < 0.5) for i in items)
                + rng.choice(["", " ", "\n"])
                + "]"
                + rng.choice(["", " ", "\r\n"])
            ).encode()
            if rng.random() < 0.4:
                start = (
                    len(history.prefix) if history.prefix is not None and rng.random() < 0.8 else 0
                )
                text = mutate(rng, text, start)
            expected = reference(text)
            try:
                end, empty = history.check(text)
            except Malformed:
                assert expected is None, text
                history = _History()  # as build_group does after a bad row
                continue
            assert expected is not None, text
            assert empty == (not expected)
            spliced = text[:end] + (b"" if empty else b",") + b'{"role":"assistant","content":"r"}]'
            assert json.loads(spliced) == [*expected, {"role": "assistant", "content": "r"}], (
                spliced
            )


def test_uids_are_uuid4_shaped_and_depend_on_seed_and_pk():
    import uuid

    a, b, c = uid(b"k" * 16, 1), uid(b"k" * 16, 2), uid(b"j" * 16, 1)
    assert len({a, b, c}) == 3 and uid(b"k" * 16, 1) == a
    for u in (a, b, c):
        parsed = uuid.UUID(u)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122 and str(parsed) == u


def test_json_nested_deeper_than_the_decoder_is_a_malformed_row_not_a_crash():
    from rollout_buffer.core.items import weight_version

    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(Malformed) as info:
        _History().check(deep.encode())
    assert info.value.reason == "json_too_deep_messages"
    with pytest.raises(Malformed) as info:
        weight_version('{"a":' * 5000 + "1" + "}" * 5000)
    assert info.value.reason == "json_too_deep_env_state"
