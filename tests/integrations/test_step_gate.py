"""StepGate: a waiting quiesce gets in between steps of an engine that steps in a loop."""

from __future__ import annotations

import threading

from kvdaemon.integrations.step_gate import StepGate


def test_a_quiesce_is_served_between_steps_of_a_busy_loop() -> None:
    gate = StepGate()
    stop = threading.Event()
    steps: list[int] = []
    log: list[str] = []

    def engine() -> None:
        while not stop.is_set():
            with gate:
                steps.append(1)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    for _ in range(20):  # a plain lock would let the loop starve these
        gate.quiesce()
        before = len(steps)
        log.append("held")
        assert len(steps) == before  # no step runs while quiesced
        gate.resume()
    stop.set()
    thread.join(5)
    assert log == ["held"] * 20 and not thread.is_alive()


def test_a_step_waits_while_quiesced() -> None:
    gate = StepGate()
    gate.quiesce()
    entered = threading.Event()

    def step() -> None:
        with gate:
            entered.set()

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    assert not entered.wait(0.2)
    gate.resume()
    assert entered.wait(5)
    thread.join(5)
