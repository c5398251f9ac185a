"""Goodput control: check what drafting measures, not what a model predicts.

The budgets (``budget``) size drafts from estimates: acceptance estimates
and the step-cost fit. This module closes the loop on outcomes, for every
method, with no vLLM and no torch:

* ``GoodputController`` (engine level) scales every row's draft by a level
  in ``LEVELS`` (all the budgets chose, half, a quarter, none). It runs the
  current level and, in short windows interleaved with it, the next level
  down and the next up; each window's steps are scored by committed tokens
  per second of engine time, normalised to a step without drafts at the
  same row count (``speedup``). When a neighbouring level scores better by
  more than ``MARGIN`` over at least ``MIN_WINDOWS`` windows each, it
  becomes the current level. A probe that keeps losing clearly is tried
  less often (its interval doubles, up to ``MAX_PROBE_GAP`` windows), so a
  method that pays loses little to its probes.
* ``RequestBackoff`` (per request) stops drafting for a request whose
  drafts failed ``FAIL_STREAK`` times in a row, for ``mute`` steps (4,
  doubling to 64 while probes fail), then lets it draft at most
  ``PROBE_TOKENS`` tokens once: an accepted token restores it.

Both only ever cut drafts, so output is unchanged (lossless verification
decides every token). Their state is bounded: the controller's is a few
numbers per level, the backoff's one record per running request, dropped
when the request leaves.
"""
from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import dataclass

#: Draft scales, from all the budgets chose down to no drafts.
LEVELS = (1.0, 0.5, 0.25, 0.0)
#: Timed steps per window.
WINDOW = 8
#: A neighbouring level must score this much better to be adopted...
MARGIN = 0.03
#: ...over at least this many windows of each (decayed counts).
MIN_WINDOWS = 1.5
#: Decay of each level's sums per window of that level.
DECAY = 0.8
#: Windows of the current level between probes: at first, and at most.
PROBE_GAP = 3
MAX_PROBE_GAP = 48
#: A probe scoring below this share of the current level counts as a clear
#: loss (its gap doubles).
CLEAR_LOSS = 0.9


class GoodputController:
    """Engine-level draft scale chosen by measured goodput (module doc)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.level = 0                       # index into LEVELS
        # per level: decayed (windows, sum of step speedups x seconds, seconds)
        self._windows = [0.0] * len(LEVELS)
        self._score = [0.0] * len(LEVELS)
        self._seconds = [0.0] * len(LEVELS)
        self._gap = [PROBE_GAP] * len(LEVELS)   # windows between probes of a level
        self._since_probe = 0                # current-level windows since the last probe
        self._next_probe_down = True
        self.active = 0                      # level of the window running now
        self._in_window = 0                  # timed steps in it so far
        self._acc = [0.0, 0.0]               # (speedup x seconds, seconds) of the window
        self.moves = 0
        self.probes = 0
        self.windows = 0
        self.history: list[tuple[int, int, float]] = []   # (window, level, score) moves

    @property
    def scale(self) -> float:
        """The scale drafts get in this step."""
        return LEVELS[self.active] if self.enabled else 1.0

    @staticmethod
    def cap(length: int, scale: float) -> int:
        """Nodes a draft of ``length`` keeps at ``scale``."""
        return length if scale >= 1.0 else int(math.ceil(length * scale))

    def record(self, speedup: float, seconds: float) -> None:
        """One timed step run at ``scale``: its tokens per second over a
        no-draft step's at the same rows (``speedup``), and its seconds."""
        if not self.enabled or not (seconds > 0 and math.isfinite(speedup)):
            return
        self._acc[0] += speedup * seconds
        self._acc[1] += seconds
        self._in_window += 1
        if self._in_window >= WINDOW:
            self._close_window()

    def score(self, level: int) -> float | None:
        """Time-weighted mean speedup of a level's recent windows."""
        return self._score[level] / self._seconds[level] if self._seconds[level] > 0 else None

    def _close_window(self) -> None:
        lv = self.active
        self._windows[lv] = self._windows[lv] * DECAY + 1.0
        self._score[lv] = self._score[lv] * DECAY + self._acc[0]
        self._seconds[lv] = self._seconds[lv] * DECAY + self._acc[1]
        self._acc = [0.0, 0.0]
        self._in_window = 0
        self.windows += 1
        if lv != self.level:                 # a probe just ended
            self._judge(lv)
            self.active = self.level
            return
        self._since_probe += 1
        probe = self._pick_probe()
        if probe is not None:
            self.active = probe
            self.probes += 1
            self._since_probe = 0

    def _pick_probe(self) -> int | None:
        down = self.level + 1 if self.level + 1 < len(LEVELS) else None
        up = self.level - 1 if self.level > 0 else None
        order = [down, up] if self._next_probe_down else [up, down]
        self._next_probe_down = not self._next_probe_down
        for lv in order:
            if lv is not None and self._since_probe >= self._gap[lv]:
                return lv
        return None

    def _judge(self, probe: int) -> None:
        cur, new = self.score(self.level), self.score(probe)
        if cur is None or new is None:
            return
        if new < CLEAR_LOSS * cur:
            self._gap[probe] = min(self._gap[probe] * 2, MAX_PROBE_GAP)
        elif (new > (1.0 + MARGIN) * cur and self._windows[probe] >= MIN_WINDOWS
              and self._windows[self.level] >= MIN_WINDOWS):
            self.history.append((self.windows, probe, round(new / cur, 4)))
            del self.history[:-16]
            self.level = probe
            self.moves += 1
            self._gap = [PROBE_GAP] * len(LEVELS)
        else:
            self._gap[probe] = PROBE_GAP

    def stats(self) -> dict:
        return {"enabled": self.enabled, "level": LEVELS[self.level],
                "active": LEVELS[self.active], "windows": self.windows,
                "probes": self.probes, "moves": self.moves,
                "scores": {str(LEVELS[i]): (None if self.score(i) is None
                                            else round(self.score(i), 4))
                           for i in range(len(LEVELS))},
                "recent_moves": [list(m) for m in self.history]}


#: Failed draft steps in a row that mute a request.
FAIL_STREAK = 3
#: Steps a request stays muted at first, and at most.
MUTE_FIRST = 4
MUTE_MAX = 64
#: Tokens a muted request drafts when probed.
PROBE_TOKENS = 2


@dataclass
class _RowRecord:
    fails: int = 0          # failed draft steps in a row
    muted: int = 0          # steps left without drafts
    mute: int = MUTE_FIRST  # the next mute's length
    drafted: int = 0        # tokens drafted last step (0: none)


class RequestBackoff:
    """Per request: stop drafting after repeated failures, probe cheaply
    later (module doc). One record per running request."""

    def __init__(self, enabled: bool = True,
                 rows: MutableMapping[str, _RowRecord] | None = None) -> None:
        """``rows``: where the per-request records are kept (the drafter's
        request records; default: a dict)."""
        self.enabled = enabled
        self._rows: MutableMapping[str, _RowRecord] = {} if rows is None else rows
        self.mutes = 0
        self.restored = 0
        self.muted_steps = 0

    def __len__(self) -> int:
        return len(self._rows)

    def settle(self, req_id: str, accepted: int) -> None:
        """The request's last draft got ``accepted`` tokens accepted."""
        rec = self._rows.get(req_id)
        if rec is None or not rec.drafted:
            return
        probed, rec.drafted = rec.fails >= FAIL_STREAK, 0
        if accepted > 0:
            if probed:
                self.restored += 1
            rec.fails, rec.mute = 0, MUTE_FIRST
            return
        rec.fails += 1
        if rec.fails >= FAIL_STREAK:
            rec.muted = rec.mute
            rec.mute = min(rec.mute * 2, MUTE_MAX)
            self.mutes += 1

    def cap(self, req_id: str, length: int) -> int:
        """Tokens the request may draft this step (at most ``length``)."""
        if not self.enabled:
            return length
        rec = self._rows.get(req_id)
        if rec is None:
            rec = self._rows[req_id] = _RowRecord()
        if rec.muted > 0:
            rec.muted -= 1
            self.muted_steps += 1
            return 0
        if rec.fails >= FAIL_STREAK:         # a probe after a mute
            length = min(length, PROBE_TOKENS)
        return length

    def drafted(self, req_id: str, tokens: int) -> None:
        """The request's draft this step has ``tokens`` tokens."""
        rec = self._rows.get(req_id)
        if rec is not None:
            rec.drafted = tokens

    def forget(self, req_id: str) -> None:
        self._rows.pop(req_id, None)

    def stats(self) -> dict:
        return {"enabled": self.enabled, "requests": len(self._rows), "mutes": self.mutes,
                "restored": self.restored, "muted_steps": self.muted_steps}
