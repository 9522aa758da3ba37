"""The bounded registry (neuron_ui/contract/registry.py): at most `size` entries, the least recently used dropped."""

import pytest

from neuron_ui.contract.registry import BoundedRegistry


def test_setting_past_the_size_drops_the_least_recently_set():
    registry: BoundedRegistry[str, int] = BoundedRegistry(2)
    registry["a"], registry["b"], registry["c"] = 1, 2, 3
    assert list(registry) == ["b", "c"] and len(registry) == 2 and "a" not in registry
    assert registry["c"] == 3 and registry.get("a") is None and registry.get("a", 0) == 0


def test_setting_again_or_using_makes_an_entry_the_most_recent_and_reading_does_not():
    registry: BoundedRegistry[str, int] = BoundedRegistry(2)
    registry["a"], registry["b"] = 1, 2
    assert registry.get("a") == 1 and "a" in registry  # reads leave the order alone
    registry["c"] = 3
    assert list(registry) == ["b", "c"]
    assert registry.use("b") == 2 and registry.use("gone") is None
    registry["d"] = 4
    assert list(registry) == ["b", "d"]
    registry["b"] = 5  # set again: most recent, its new value
    registry["e"] = 6
    assert list(registry) == ["b", "e"] and registry["b"] == 5


def test_pop_takes_an_entry_once():
    registry: BoundedRegistry[str, str] = BoundedRegistry(4)
    registry["own"] = "other"
    assert registry.pop("own", "own") == "other" and registry.pop("own", "own") == "own" and len(registry) == 0


def test_a_size_of_zero_holds_nothing_and_a_negative_one_is_refused():
    off: BoundedRegistry[str, int] = BoundedRegistry(0)
    off["a"] = 1
    assert len(off) == 0 and off.use("a") is None
    with pytest.raises(ValueError, match="count of entries"):
        BoundedRegistry(-1)
