"""Eviction policies: the order in which keys are offered for eviction."""

from __future__ import annotations

import pytest

from kvtier.storage.policy import POLICIES, SizedIndex, make_policy


def order(policy):
    return list(policy.candidates())


def filled(name):
    policy = make_policy(name)
    for key in "abcd":
        policy.add(key)
    return policy


def test_lru():
    p = filled("LRU")
    p.touch("a")
    assert order(p) == ["b", "c", "d", "a"]


def test_mru():
    p = filled("mru")
    p.touch("b")
    assert order(p) == ["b", "d", "c", "a"]


def test_fifo_ignores_access():
    p = filled("FIFO")
    p.touch("a")
    assert order(p) == ["a", "b", "c", "d"]


def test_lfu_frequency_then_recency():
    p = filled("LFU")
    p.touch("a")
    p.touch("a")
    p.touch("c")
    assert order(p) == ["b", "d", "c", "a"]
    p.remove("b")
    assert order(p) == ["d", "c", "a"]
    p.add("b")  # re-added keys start over at frequency 1
    assert order(p) == ["d", "b", "c", "a"]


@pytest.mark.parametrize("name", POLICIES)
def test_remove_and_len(name):
    p = filled(name)
    p.remove("c")
    p.remove("zzz")  # absent: no error
    p.touch("zzz")
    assert len(p) == 3 and set(order(p)) == {"a", "b", "d"}


def test_unknown_policy_names_choices():
    with pytest.raises(ValueError, match=r"cache_policy='ARC'.*LRU, LFU, FIFO, MRU"):
        make_policy("ARC")


# -- the sized index every bounded byte store keeps -------------------------------------


def test_a_sized_index_evicts_in_policy_order_until_a_size_fits():
    index = SizedIndex(100, "LRU")
    for name in "abc":
        assert index.reserve(name, 30) == []
    index.touch("a")
    assert index.reserve("d", 40) == ["b"]  # 90 - 30 + 40 = 100
    assert index.used == 100 and index.names() == ["a", "c", "d"]
    assert index.first() == "c"
    assert index.reserve("huge", 101) is None and index.used == 100  # never fits: unchanged


def test_adding_an_indexed_name_replaces_its_entry():
    """The one rule for a name written again (the disk tier and the node server's blob
    stores share it): its new size counts, not its old one, and it is a new entry."""
    index = SizedIndex(100, "LFU")
    index.add("a", 10)
    index.add("b", 10)
    index.touch("a")
    index.add("a", 25)
    assert index.used == 35 and len(index) == 2
    assert index.first() == "b"  # "a" starts over at frequency 1, newer than "b"
    index.touch("b")
    assert index.first() == "a"
    assert index.reserve("a", 90) == []  # its own old entry counts as room: 10 + 90
    assert index.reserve("a", 95) == ["b"]
    assert index.used == 95 and index.names() == ["a"]


def test_an_unbounded_index_never_evicts():
    index = SizedIndex(None)
    index.add("a", 1 << 40)
    assert index.make_room(1 << 50) == [] and index.reserve("b", 1 << 50) == []
    assert index.used == (1 << 40) + (1 << 50)
    index.clear()
    assert len(index) == 0 and index.used == 0 and index.first() is None


def test_shedding_drops_a_size_and_a_count_in_policy_order_but_keeps_one_name():
    index = SizedIndex(100, "LRU")
    for name, size in [("a", 10), ("b", 30), ("c", 20), ("d", 40)]:
        index.add(name, size)
    # the oldest ("a") is the one written: it stays; "b" alone frees the 25 bytes asked
    assert index.shed(25, keep="a") == ["b"]
    assert index.shed(1, keep="a", at_least=2) == ["c", "d"]
    assert index.names() == ["a"] and index.used == 10
    assert index.shed(50, keep="a") == []  # nothing else to drop
