"""core/loop/callbacks.py: callback state in checkpoints is keyed by name, not by position."""

from __future__ import annotations

from bert_mp.core.loop.callbacks import BaseCallback, callback_states, load_callback_states, state_keys


class Counter(BaseCallback):
    def __init__(self, name: str, n: int = 0):
        super().__init__(cfg=None)
        self.name, self.n = name, n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, d: dict) -> None:
        self.n = d["n"]


def test_each_callback_gets_its_own_state_back_whatever_the_order():
    saved = callback_states([Counter("a", 1), Counter("b", 2)])
    assert saved == {"a": {"n": 1}, "b": {"n": 2}}
    b, a, new = Counter("b"), Counter("a"), Counter("c")
    load_callback_states([b, new, a], saved)
    assert (a.n, b.n, new.n) == (1, 2, 0)


def test_a_name_listed_twice_keeps_two_states():
    twice = [Counter("a", 1), Counter("b", 2), Counter("a", 3)]
    assert state_keys(twice) == ["a", "b", "a#2"]
    again = [Counter("a"), Counter("b"), Counter("a")]
    load_callback_states(again, callback_states(twice))
    assert [c.n for c in again] == [1, 2, 3]


def test_position_keyed_states_still_load_where_the_class_and_position_match():
    old = {"0:Counter": {"n": 5}, "1:Other": {"n": 6}}
    first, second = Counter("x"), Counter("y")
    load_callback_states([first, second], old)
    assert (first.n, second.n) == (5, 0)
