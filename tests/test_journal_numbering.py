"""The journal writer's number bookkeeping (``Numbering``) keeps the invariants its docstring
states, whatever a writer's puts meet: landed, taken by another writer, failed, skipped above
commits found there, numbers learned from headers. ``test_journal_sim.py`` checks the same class
through the real writer; this drives it alone, against a model of the store's numbers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_capture.journal.numbering import Numbering

Op = st.sampled_from(["take", "land", "taken", "fail", "skip", "learn", "pay", "begin"])


def _check(numbers: Numbering, exists: set[int]) -> None:
    assert all(n in exists for n in range(numbers.floor)), "a number below the floor is missing"
    assert numbers.floor not in numbers.known and all(n >= numbers.floor for n in numbers.known)
    assert not numbers.trying & numbers.debts
    assert numbers.landed <= exists and all(n >= numbers.floor for n in numbers.landed)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(Op, st.integers(0, 5)), max_size=60))
def test_the_bookkeeping_keeps_its_invariants(ops: list[tuple[str, int]]) -> None:
    numbers = Numbering()
    exists: set[int] = set()  # the store's numbers (commits or tombstones)
    out: list[int] = []  # handed out, in order
    for op, k in ops:
        if op == "take":
            seq = numbers.take()
            if seq is None:
                free = next(n for n in range(numbers.floor, 10_000) if n not in exists)
                seq = numbers.start_at(free, {n for n in exists if n < free})
            if out and seq < max(out):  # only a failed last number (and debts below) come back
                assert seq not in exists
            out.append(seq)
            assert numbers.tickets[seq] == max(numbers.tickets.values())
        elif not numbers.trying:
            continue
        elif op in ("land", "taken", "fail", "skip"):
            seq = sorted(numbers.trying)[k % len(numbers.trying)]
            if op == "land" and seq not in exists:
                exists.add(seq)
                numbers.took(seq)
            elif op == "taken" or (op == "land" and seq in exists):
                exists.add(seq)
                numbers.lost(seq)
                numbers.learn(seq)
            elif op == "fail":
                numbers.failed(seq)
            else:
                above = seq + 1 + k % 3
                exists.add(above)
                numbers.learn(above)
                existed = seq in exists
                new = numbers.skip(seq, [above])
                assert new > above and (seq in numbers.debts) != existed  # filled unless it exists

                out.append(new)
        elif op == "begin" and numbers.next is None:
            free = next(n for n in range(numbers.floor, 10_000) if n not in exists)
            numbers.begin_at(free, {n for n in exists if n < free})
            assert numbers.next == free and not numbers.trying
        elif op == "learn" and exists:
            numbers.learn(sorted(exists)[k % len(exists)])
        elif op == "pay" and numbers.debts:
            debt = sorted(numbers.debts)[k % len(numbers.debts)]
            exists.add(debt)
            numbers.learn(debt)
            numbers.paid(debt)
        _check(numbers, exists)


def test_an_own_commit_handed_out_after_does_not_count_above_but_one_before_does() -> None:
    """A number this writer handed out later and landed holds other rollouts, taken after: no
    reason to skip. One handed out before (its put landed, its answer lost, then the number below
    handed out again) may hold earlier rows: skip it."""
    numbers = Numbering(next=4)
    four, five = numbers.take(), numbers.take()
    assert (four, five) == (4, 5)
    numbers.took(5)
    assert numbers.others_above(4, [5]) == []
    numbers = Numbering(next=4)
    four, five = numbers.take(), numbers.take()
    numbers.failed(5)  # it landed, but this writer never heard
    numbers.failed(4)
    assert numbers.take() == 4 and numbers.others_above(4, [5]) == [5]
