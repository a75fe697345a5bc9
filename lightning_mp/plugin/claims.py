"""One run at a time per plugin: the thread whose run the plugin drives holds it until that run's teardown.

A plugin's scaler and opt level hold one run's state, so two Trainers (or Fabric loops) that share a plugin from two
threads would corrupt each other's steps. A run claims the plugin when its model is converted; a claim by another
thread fails while the holder's thread is alive, and a teardown from another thread than the holder's (a second
Trainer that was refused the plugin) releases nothing. One lock serialises every claim and release, so a thread sees
no other thread's claim half made.

A released run has ended: the next setup (other than a Trainer's validate, test or predict after its fit) starts a
new run, with a new opt level and scaler, as a new plugin would; a state loaded in between is that new run's.
"""

from __future__ import annotations

import threading

_CLAIMS = threading.Lock()
"""Serialises the claims and releases of every plugin."""


class RunClaim:
    """Which thread's run a plugin drives now (none before the first run and after a teardown), and whether it ended.

    Args:
        ended: whether the last run was torn down.

    """

    def __init__(self, ended: bool = False) -> None:
        self.thread: int | None = None
        """The ident of the thread whose run (a Trainer's fit, or a Fabric loop) holds the plugin."""
        self.ended = ended
        """Whether the last run was torn down: the next setup (other than a Trainer's validate, test or predict after
        a fit) starts a new run."""

    def claim(self, plugin: object) -> bool:
        """Make this thread's run the plugin's one run.

        Returns:
            Whether the previous run had ended (its teardown) before this claim.

        Raises:
            RuntimeError: when a run of another live thread holds the plugin, naming ``plugin`` and the fix.

        """
        with _CLAIMS:
            if self._held_by_another_thread():
                raise RuntimeError(
                    f"{plugin!r} is already driving a run in another thread, and one plugin drives one run at a time:"
                    " its scaler and opt level hold that run's state. Give each Trainer or Fabric its own plugin"
                    " (copy.deepcopy(plugin) copies the settings), or start this run after the other ended (its"
                    " teardown)."
                )
            self.thread = threading.get_ident()
            ended, self.ended = self.ended, False
            return ended

    def release(self, had_run: bool) -> bool:
        """Free the plugin for another run; the run ended if there was one (``had_run``).

        Returns:
            False, releasing nothing, when a run of another live thread holds the plugin.

        """
        with _CLAIMS:
            if self._held_by_another_thread():
                return False
            self.thread = None
            self.ended = had_run
            return True

    def _held_by_another_thread(self) -> bool:
        owner = self.thread
        return owner not in (None, threading.get_ident()) and any(t.ident == owner for t in threading.enumerate())


__all__ = ["RunClaim"]
