import numpy as np
import pytest
import torch

from hicached.common.keys import (
    all_valid_keys,
    check_keys,
    check_namespace,
    page_keys,
    valid_key,
    valid_namespace,
)

VECTOR = [
    "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
    "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052",
]


def sglang_reference(token_ids, page_size, prior=None):
    """SGLang's get_hash_str applied page by page, token by token (the slow original)."""
    import hashlib

    keys = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in token_ids[start : start + page_size]:
            h.update(int(t).to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        keys.append(prior)
    return keys


def test_test_vector():
    assert page_keys(list(range(8)), 4) == VECTOR


@pytest.mark.parametrize("make", [list, np.array, lambda x: np.array(x, dtype=np.int64), torch.tensor])
def test_input_types_agree(make):
    assert page_keys(make(list(range(8))), 4) == VECTOR


def test_matches_sglang_reference_on_random_prompt():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 2**32 - 1, size=64 * 37 + 5, dtype=np.uint64).tolist()
    assert page_keys(tokens, 64) == sglang_reference(tokens, 64)


def test_prior_continues_the_chain():
    tokens = list(range(40))
    whole = page_keys(tokens, 4)
    assert page_keys(tokens[16:], 4, prior=whole[3]) == whole[4:]


def test_partial_page_has_no_key():
    assert page_keys(list(range(7)), 4) == VECTOR[:1]
    assert page_keys([], 4) == []


@pytest.mark.parametrize(
    "tokens,page_size",
    [([-1, 2, 3, 4], 4), ([2**32], 1), ([1.5, 2.0], 1), ([[1, 2]], 1), ([1], 0), ([1], True)],
)
def test_bad_input(tokens, page_size):
    with pytest.raises(ValueError):
        page_keys(tokens, page_size)


def test_bad_prior():
    with pytest.raises(ValueError):
        page_keys([1, 2], 1, prior="abcd")


def test_namespaces():
    assert valid_namespace("llama-3.1-8b.bf16.p64.tp0of2")
    for bad in ["", ".", "..", "a/b", "a b", "x" * 129, None, 3, "ns:1"]:
        assert not valid_namespace(bad)
    with pytest.raises(ValueError, match="invalid namespace"):
        check_namespace("a/b")


def test_keys_validation():
    assert valid_key(VECTOR[0])
    for bad in ["", "../x", "a.b", "a/b", "k" * 129, 5, None]:
        assert not valid_key(bad)
    with pytest.raises(ValueError, match="invalid key"):
        check_keys(["ok", "no/pe"])


def test_trailing_newline_is_not_a_valid_key_or_namespace():
    # Regression: `^...$` with re.match let "ab\n" through, and such names reached file paths.
    assert not valid_key("ab\n") and not valid_namespace("ns\n")
    with pytest.raises(ValueError):
        check_keys(["ab\ncd"])  # would split into two valid-looking keys when joined
    with pytest.raises(ValueError):
        check_keys(["ok", "é"])


@pytest.mark.parametrize(
    "keys, ok",
    [
        ([], True),
        (["a" * 64, "B_-9", "x" * 128], True),
        (["a" * 64, "x" * 129], False),
        (["a" * 64, ""], False),
        (["ok", "no/pe"], False),
        (["ab\ncd"], False),
        (["ok", "é"], False),
        (["ok", 7], False),
    ],
)
def test_all_valid_keys_agrees_with_valid_key(keys, ok: bool) -> None:
    assert all_valid_keys(keys) is ok
    assert all(valid_key(k) for k in keys) is ok
