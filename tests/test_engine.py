"""Engine pieces that every backend shares."""

from __future__ import annotations

from localllm.engine import StopMatcher


def test_stop_matcher_holds_back_only_possible_prefixes() -> None:
    m = StopMatcher(["###", "END"])
    assert m.feed("hello #") == ("hello ", False)
    assert m.feed("#") == ("", False)
    assert m.feed("# tail") == ("", True)
    m = StopMatcher(["###"])
    assert m.feed("a #") == ("a ", False)
    assert m.feed("b") == ("#b", False)
    assert m.feed("ends with #") == ("ends with ", False) and m.flush() == "#"
    assert StopMatcher([]).feed("x") == ("x", False)
