"""The stand-ins capture gives build()'s code for an optimizer's param groups and a scheduler's
last lrs (``graphamp/capture/optimizer_views.py``): what they report, what they refuse, and
that a copy of one is the plain container."""

import copy
import pickle

import pytest

import graphamp
from graphamp.capture.optimizer_views import GroupView, RecordedList


def _view():
    seen = []
    group = {"lr": 0.1, "betas": (0.9, 0.99), "params": [object()]}
    view = GroupView(group, "opt.param_groups[0]", lambda g, k, v, label, f: seen.append((k, v)))
    return group, view, seen


def test_a_group_view_reports_the_entries_read_but_not_the_parameters():
    group, view, seen = _view()
    assert view["lr"] == 0.1 and view.get("betas") == (0.9, 0.99) and view.get("eps", 1) == 1
    assert view["params"] is group["params"]
    assert seen == [("lr", 0.1), ("betas", (0.9, 0.99))]
    seen.clear()
    assert dict(view.items()) == group and list(view.values()) == list(group.values())
    assert {k for k, _ in seen} == {"lr", "betas"}


@pytest.mark.parametrize(
    "write",
    [
        lambda v: v.__setitem__("lr", 0.5),
        lambda v: v.update(lr=0.5),
        lambda v: v.setdefault("eps", 1e-8),
        lambda v: v.pop("lr"),
        lambda v: v.__delitem__("lr"),
        lambda v: v.clear(),
    ],
)
def test_a_group_view_refuses_a_write_and_leaves_the_group_as_it_was(write):
    group, view, _ = _view()
    with pytest.raises(graphamp.CaptureError, match="before build\\(\\) runs"):
        write(view)
    assert group["lr"] == 0.1 and "eps" not in group


def test_a_write_of_the_value_already_there_is_let_through():
    group, view, _ = _view()
    view["lr"] = group["lr"]
    assert group["lr"] == 0.1


def test_copies_of_the_stand_ins_are_plain_containers():
    _, view, _ = _view()
    for made in (copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert type(made) is dict and made["lr"] == 0.1
        made["lr"] = 0.5  # the user's own copy
    lrs = RecordedList([0.1, 0.2], lambda i, v: None)
    assert type(copy.deepcopy(lrs)) is list and copy.copy(lrs) == [0.1, 0.2]


def test_a_recorded_list_reports_the_items_read_by_index_slice_and_iteration():
    seen = []
    lrs = RecordedList([0.1, 0.2, 0.3], lambda i, v: seen.append((i, v)))
    assert lrs[-1] == 0.3 and lrs[:2] == [0.1, 0.2]
    assert seen == [(2, 0.3), (0, 0.1), (1, 0.2)]
    seen.clear()
    assert max(lrs) == 0.3 and len(seen) == 3
