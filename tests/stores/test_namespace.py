"""The stored-key encoding of the SQL and memory stores: injective, and scannable per namespace."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from oncely.stores import _namespace

_text = st.text(alphabet=st.sampled_from("ab:|%3AC;é"), max_size=6)


@given(first=st.tuples(_text, _text), second=st.tuples(_text, _text))
def test_stored_keys_are_injective(first: tuple[str, str], second: tuple[str, str]) -> None:
    """Two different (namespace, key) pairs never share a stored key."""
    if first != second:
        assert _namespace.stored_key(*first) != _namespace.stored_key(*second)


@given(namespace=_text, key=_text, other=_text)
def test_each_stored_key_belongs_to_its_namespace_only(
    namespace: str, key: str, other: str
) -> None:
    """A stored key is a member of its own namespace and of no other, and decodes back."""
    stored = _namespace.stored_key(namespace, key)
    assert _namespace.caller_key(namespace, stored) == key
    assert _namespace.member(namespace)(stored)
    if other != namespace:
        assert not _namespace.member(other)(stored)


def test_the_common_case_is_stored_as_before() -> None:
    """Plain namespaces and scoped default-namespace keys keep their earlier stored form."""
    assert _namespace.stored_key("billing", "scope|k:1") == "billing:scope|k:1"
    assert _namespace.stored_key("", "scope|k:1") == "scope|k:1"
    assert _namespace.stored_key("", "plain") == "plain"
