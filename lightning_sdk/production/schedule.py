"""[learn]'s schedule: one background thread that, every learn.poll_seconds, runs an update once it is due
(learn.every_rewarded new rewards, or learn.every_minutes with at least one) and takes its candidate to the gate.

A failed update or eval is logged and counted (`failures`), and the server keeps serving what it served: a fault
of the learning side never stops serving. Its rewards stay unread, so the next pass tries them again, up to
learn.max_update_failures times in a row; then they are quarantined (production.learner) and learning goes on.
A canary that cannot be judged (its check raised) is said in one line, once per distinct reason, not a traceback
each poll; the canary keeps serving its share, the update runs as due, and the next poll judges it again.
"""

from __future__ import annotations

import logging

from lightning_sdk.production.learner import Learner, Update
from lightning_sdk.production.periodic import Periodic
from lightning_sdk.production.promotion import Promoter

log = logging.getLogger("lightning_sdk")


class Schedule:
    def __init__(self, learner: Learner, promoter: Promoter, poll_seconds: float):
        self.learner, self.promoter, self.poll_seconds = learner, promoter, poll_seconds
        learner.follow(promoter.in_service())  # after a restart: never from a candidate that was not put in service
        self.last: Update | None = None  # what the latest update read, trained and left out
        self.canary_fault: str | None = None  # the last canary check's failure, said once
        self._thread = Periodic(self.run_once, poll_seconds, name="lightning-learn",
                                on_failure="learn: the update or its gate failed; serving goes on with the adapter "
                                           "it served")

    @property
    def failures(self) -> int:
        return self._thread.failures

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """After the update in progress, if any (its commit written)."""
        self._thread.stop()

    def run_once(self) -> Update | None:
        """A running canary's verdict, if due; then one update and its gate, if due; what the update read, trained
        and left out."""
        try:
            verdict = self.promoter.check_canary()
            self.canary_fault = None
        except Exception as e:  # noqa: BLE001 - said once; learning and serving go on, the next poll tries again
            verdict = None
            fault = (f"learn: the canary cannot be judged now ({type(e).__name__}: {str(e)[:200]}); "
                     "it keeps its share, tried again each poll")
            if fault != self.canary_fault:
                log.warning("%s", fault)
            self.canary_fault = fault
        if verdict is not None:
            log.info("learn: canary %s %s", verdict.candidate, verdict.reason)
            self.learner.follow(self.promoter.in_service())
        if not self.learner.due():
            return None
        update = self.learner.update()
        self.last = update
        if update.quarantined:
            log.warning("learn: %d reward(s) quarantined, consumed untrained (%d in all since start): %s",
                        update.quarantined, self.learner.quarantined, update.reason)
            return update
        if update.version is None:
            left = ", ".join(f"{n} {why}" for why, n in sorted(update.skipped.items()))
            log.info("learn: %d reward(s) read, nothing could train (%d stale, %d without a baseline%s)%s",
                     update.rewards, update.stale, update.no_baseline, f", {left}" if left else "",
                     f": {update.reason}" if update.reason else "")
            return update
        decision = self.promoter.consider(update)
        self.learner.follow(self.promoter.in_service())  # a candidate not put in service is not trained on
        log.info("learn: update %d on %d call(s) (%d stale left out): %s, %s", update.version, update.calls,
                 update.stale, "promoted" if decision.promoted else "rejected", decision.reason)
        return update
