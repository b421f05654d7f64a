"""Deferred reading of device tensors: the queue logic of DeferredValues, run with CPU
tensors and a fake CUDA event (the hardware seam) because this machine has no GPU."""

from __future__ import annotations

from typing import ClassVar

import pytest

from forewarn.hook._tensors import DeferredValues, is_tensor, read_now

torch = pytest.importorskip("torch")


class FakeEvent:
    """Stands in for torch.cuda.Event: completes when the test says so."""

    instances: ClassVar[list[FakeEvent]] = []

    def __init__(self) -> None:
        self.done = False
        self.synced = False
        FakeEvent.instances.append(self)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced = True
        self.done = True


def test_read_now_takes_floats_and_cpu_tensors_without_torch_for_floats() -> None:
    assert read_now(1.5) == (True, 1.5)
    assert read_now(None) == (True, None)
    assert read_now(3) == (True, 3.0)
    assert read_now(torch.tensor(2.5)) == (True, 2.5)
    assert is_tensor(torch.tensor(1.0)) and not is_tensor(1.0)


def test_values_are_released_in_order_only_when_their_event_completed() -> None:
    FakeEvent.instances = []
    d = DeferredValues(depth=3, event_factory=FakeEvent, pin_memory=False)
    for step in range(3):
        assert d.submit(step, 100.0 + step, 0.1, {}, torch.tensor(float(step)), None) is None
    assert d.ready() == [] and len(d) == 3
    FakeEvent.instances[1].done = True  # a later copy landing first releases nothing
    assert d.ready() == []
    FakeEvent.instances[0].done = True
    got = [(p.step, p.time, loss, gn) for p, loss, gn in d.ready()]
    assert got == [(0, 100.0, 0.0, None), (1, 101.0, 1.0, None)]
    # ring full? one slot is still busy (step 2), two are free again
    assert d.submit(3, 103.0, 0.1, {}, torch.tensor(3.0), torch.tensor(9.0)) is None
    assert d.submit(4, 104.0, 0.1, {}, torch.tensor(4.0), None) is None
    assert d.submit(5, 105.0, 0.1, {}, torch.tensor(5.0), None) == (None, None)  # no slot
    assert d.values_skipped == 1
    rest = [(p.step, loss, gn) for p, loss, gn in d.ready(wait=True)]  # close(): may wait
    assert rest == [(2, 2.0, None), (3, 3.0, 9.0), (4, 4.0, None)]
    assert all(e.synced for e in FakeEvent.instances[2:])
