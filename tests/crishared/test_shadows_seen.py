"""Whether the list verbs hide shadows: set before a shadow exists, cleared only by a look that saw it all."""

from __future__ import annotations

from shim.crishared.mark import ShadowsSeen


def test_a_shadow_being_made_is_hidden_before_containerd_has_it() -> None:
    seen = ShadowsSeen()
    assert not seen.present
    seen.making()
    assert seen.present


def test_a_look_that_began_before_a_shadow_was_made_does_not_clear_it() -> None:
    seen = ShadowsSeen(present=True)
    since = seen.looking()  # the reconciler lists containerd: no shadow yet
    seen.making()  # meanwhile the host makes one
    assert not seen.looked(False, since)
    assert seen.present, "a stale list must not make the new shadow visible to kubelet"


def test_a_look_that_saw_everything_clears_it_and_says_so() -> None:
    seen = ShadowsSeen(present=True)  # as the agent starts: hidden before anything has looked
    assert seen.looked(False, seen.looking())
    assert not seen.present
    assert not seen.looked(False, seen.looking()), "unchanged"


def test_a_look_that_finds_shadows_sets_it() -> None:
    seen = ShadowsSeen()
    assert seen.looked(True, seen.looking())
    assert seen.present
