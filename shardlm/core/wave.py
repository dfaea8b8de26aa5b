"""Lock-step of data parallel replicas that share their MoE layers (DP attention + EP experts).

Under expert parallel across replicas every MoE layer all-gathers the replicas' tokens, so each
replica must run a forward in every step that any replica runs one. A stretch of steps in which
some replica has work is a *wave* (vLLM's word). In a wave, a replica with nothing scheduled
runs a dummy forward (its MoE layers only, with no tokens of its own). The step in which every
replica ran a dummy (the all-gathered token count is zero everywhere) ends the wave for all of
them at once, and they sleep until the next request: nothing spins while the server is idle.

Waves are numbered the same on every replica (they all end each one together). A replica that
gets a request while idle starts the current wave and tells the client (WaveStarted), which
passes StartWave(n) to the others; a StartWave for a wave that has already ended is stale and
ignored, so no replica can start a wave alone.
"""

from __future__ import annotations


class Wave:
    def __init__(self):
        self.number = 0          # the wave running, or the next one when idle
        self.running = False

    def begin(self) -> int | None:
        """This replica has work. -> the wave's number if it started it (the others must be told)."""
        if self.running:
            return None
        self.running = True
        return self.number

    def join(self, number: int) -> None:
        """Another replica started wave `number`."""
        if not self.running and number >= self.number:
            self.number, self.running = number, True

    def finish(self) -> None:
        """Every replica ran a dummy step: all of them end this wave together."""
        self.running = False
        self.number += 1
