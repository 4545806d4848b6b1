"""Eviction policies: the order in which keys are offered for eviction."""

from __future__ import annotations

import pytest

from kvtier.storage.policy import POLICIES, make_policy


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
