"""Worker extension that byte-compares the paged KV cache around online scoring steps (tests only).

Online layer selection scores candidate skip sets with forwards that must write no KV (slot -1
everywhere, see ``online_scoring.score_forward``). ``selfspec_online_arm_kv_check(count)`` wraps
the selector of this worker's drafter so that its next ``count`` scoring steps compare every KV
cache tensor before and after; ``write_slots=True`` is the negative control: those steps score
with the real slots (the positions' verified K/V overwritten by the draft's), so the check must
fail. ``selfspec_online_kv_checks()`` returns (checks, failures). Production code has no switch
for this.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.pinned_costs import PinnedCostsExtension

ONLINE_KV_PROBE_EXTENSION = "tests.online_kv_probe.OnlineKVProbe"


class OnlineKVProbe(PinnedCostsExtension):
    _kv_probe: dict[str, Any] | None = None

    def selfspec_online_arm_kv_check(self, count: int = 1, write_slots: bool = False) -> bool:
        online = getattr(getattr(self.model_runner, "drafter", None), "online", None)
        if online is None:
            return False
        if self._kv_probe is None:
            self._kv_probe = {"left": 0, "write": False, "checks": 0, "failures": 0}
            _wrap_scoring(online, self._kv_probe)
        self._kv_probe.update(left=int(count), write=bool(write_slots))
        return True

    def selfspec_online_kv_checks(self) -> tuple[int, int]:
        probe = self._kv_probe or {"checks": 0, "failures": 0}
        return probe["checks"], probe["failures"]


def _wrap_scoring(online: Any, probe: dict[str, Any]) -> None:
    score, run = online._score, online._run

    def _score(window: dict[str, Any]) -> None:
        if probe["left"] <= 0:
            return score(window)
        before = [t.clone() for t in online.runner_view.runner.kv_caches]
        if probe["write"]:  # the scoring passes pass write_kv=False: overridden here
            online._run = lambda **kw: run(**{**kw, "write_kv": True})
        try:
            score(window)
        finally:
            online._run = run
        probe["left"] -= 1
        probe["checks"] += 1
        after = online.runner_view.runner.kv_caches
        if len(after) != len(before) or not all(
            torch.equal(a, b) for a, b in zip(before, after, strict=True)
        ):
            probe["failures"] += 1
        return None

    online._score = _score
