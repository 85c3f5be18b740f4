"""A journal writer's knowledge of one stream's commit numbers, and the numbers it hands out.

Pure bookkeeping: no I/O, no clock, no lock (the writer calls it under its own lock), so the
promises below are what ``tests/test_journal_sim.py`` checks through the writer and what
``tests/test_journal_numbering.py`` checks of the class alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Numbering:
    """What a writer knows of a stream's numbers, and what it has handed out.

    Invariants (each method keeps them):

    - every number below :attr:`floor` exists (a commit or a tombstone);
    - :attr:`known` holds numbers at or above the floor known to exist; the floor never stands
      on a known number (it climbs past them);
    - :attr:`trying` (handed out, put in progress) and :attr:`debts` (handed out, given up or
      failed, with later numbers handed out) are disjoint; a debt is filled with a tombstone by
      this writer before any commit of it above the debt is acknowledged;
    - numbers are handed out in increasing order, except that a failed put whose number was the
      last handed out (nothing above it handed out) is handed out again, with any debts just
      below it; :attr:`tickets` records the order, so "handed out after" is always decidable;
    - :attr:`landed` holds this writer's numbers its puts landed at (at or above the floor).
    """

    next: int | None = None  # the number handed out next; None: look the tail up first
    floor: int = 0
    known: set[int] = field(default_factory=set)
    trying: set[int] = field(default_factory=set)
    debts: set[int] = field(default_factory=set)
    filling: set[int] = field(default_factory=set)  # numbers a thread of the writer resolves now
    missing: dict[int, float] = field(default_factory=dict)  # others' numbers seen missing: since when
    tickets: dict[int, int] = field(default_factory=dict)  # ours at or above the floor: hand-out order
    landed: set[int] = field(default_factory=set)
    _issued: int = 0

    # -- handing out

    def take(self) -> int | None:
        """The next number, or ``None`` when the tail must be looked up first (:meth:`start_at`)."""
        if self.next is None:
            return None
        return self._hand_out(self.next)

    def start_at(self, found: int, seen: set[int]) -> int:
        """The tail was looked up: ``found`` is free, ``seen`` exist; hand out from there."""
        self.known |= seen
        self._normalize()
        return self._hand_out(max(found, self.next or 0))

    def begin_at(self, found: int, seen: set[int]) -> None:
        """The tail was looked up (for a look, nothing handed out): hand out from ``found`` on."""
        self.known |= seen
        self._normalize()
        self.next = max(found, self.next or 0)

    def skip(self, seq: int, above: list[int]) -> int:
        """Give ``seq`` up (a debt: it is filled with a tombstone, unless known to exist) because
        commits exist above it; hand out the number past the highest of them."""
        self.trying.discard(seq)
        if seq >= self.floor and seq not in self.known:
            self.debts.add(seq)
        return self._hand_out(max(self.next or 0, max(above) + 1))

    def _hand_out(self, seq: int) -> int:
        self.next = seq + 1
        self.trying.add(seq)
        self._issued += 1
        self.tickets[seq] = self._issued
        return seq

    def others_above(self, seq: int, there: list[int]) -> list[int]:
        """Of the numbers found existing above ``seq``, those that may hold rows submitted before
        ``seq``'s: all but this writer's own landed commits handed out after ``seq`` (they hold
        other rollouts, taken later). An own commit whose put landed unbeknown counts (safe)."""
        after = self.tickets.get(seq, 0)
        return [n for n in there if not (n in self.landed and self.tickets.get(n, 0) > after)]

    # -- what happened to a number

    def took(self, seq: int) -> None:
        """Our put at ``seq`` landed."""
        self.trying.discard(seq)
        self.known.add(seq)
        self.landed.add(seq)
        self._normalize()

    def lost(self, seq: int) -> None:
        """Our put at ``seq`` found another's commit there."""
        self.trying.discard(seq)

    def failed(self, seq: int) -> None:
        """Our put at ``seq`` failed: handed out again when it was the last handed out (with the
        debts just below it), else a debt."""
        self.trying.discard(seq)
        if self.next == seq + 1:
            self.next = seq
            while self.next - 1 in self.debts:
                self.debts.discard(self.next - 1)
                self.next -= 1
        else:
            self.debts.add(seq)

    def learn(self, seq: int, floor: int = 0) -> None:
        """``seq`` exists, and every number below ``floor`` did when it was written."""
        self.known.add(seq)
        self.missing.pop(seq, None)
        self.floor = max(self.floor, floor)
        self._normalize()

    def raise_floor(self, floor: int) -> None:
        """Every number below ``floor`` exists (a reader read them)."""
        self.floor = max(self.floor, floor)
        self._normalize()

    def paid(self, seq: int) -> None:
        """A debt's tombstone landed (or another commit was there)."""
        self.debts.discard(seq)

    def missing_since(self, seq: int, now: float) -> float:
        """When another's number ``seq`` was first seen missing."""
        return self.missing.setdefault(seq, now)

    # -- settling

    def settled(self, seq: int) -> bool:
        """Whether every number below ``seq`` exists."""
        return self.floor > seq

    def to_resolve(self, seq: int, window: int) -> tuple[list[int], list[int]]:
        """Numbers below ``seq`` to resolve now, marked as being resolved: our debts (to fill) and
        others' numbers (to read); ours in flight and those another thread resolves are left.
        A long way below (more than ``window``): the highest unknown only, its header's floor
        says much of the rest."""
        if seq - self.floor > window:
            n = seq - 1
            while n > self.floor and n in self.known:
                n -= 1
            unknown = [n]
        else:
            unknown = [n for n in range(self.floor, seq) if n not in self.known]
        debts = [n for n in unknown if n in self.debts and n not in self.filling]
        others = [
            n for n in unknown if n not in self.trying and n not in self.debts and n not in self.filling
        ]
        self.filling |= {*debts, *others}
        return debts, others

    def resolved(self, seqs: list[int]) -> None:
        self.filling.difference_update(seqs)

    def _normalize(self) -> None:
        while self.floor in self.known:
            self.floor += 1
        floor = self.floor
        if self.known and min(self.known) < floor:
            self.known = {n for n in self.known if n >= floor}
        if self.missing and min(self.missing) < floor:
            self.missing = {n: t for n, t in self.missing.items() if n >= floor}
        if self.tickets and min(self.tickets) < floor:
            self.tickets = {n: t for n, t in self.tickets.items() if n >= floor}
            self.landed = {n for n in self.landed if n >= floor}
