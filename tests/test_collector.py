"""The run's garbage collection between steps (run/collector.py): automatic collection off while training, cycles a
step made freed between steps, the objects alive after the first step frozen, the interpreter restored at the end."""

import gc
import weakref

from megatrain.run.collector import StepCollector


class Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the cyclic collector frees it


def test_cycles_freed_between_steps_and_not_during():
    was = gc.isenabled()
    c = StepCollector()
    try:
        assert not gc.isenabled()
        kept = [Node() for _ in range(10)]  # alive across steps: frozen by the first collection
        assert c.between_steps() >= 0.0 and c.frozen
        assert gc.get_freeze_count() >= len(kept)
        garbage = Node()
        ref = weakref.ref(garbage)
        del garbage
        for _ in range(3 * max(gc.get_threshold()[0], 700)):  # allocations that would trigger an automatic pass
            Node().other = None
        assert ref() is not None  # no collection ran inside the "step"
        c.between_steps()
        assert ref() is None  # the collection between steps freed the cycle
    finally:
        c.close()
    assert gc.isenabled() == was
    assert gc.get_freeze_count() == 0  # what the run froze is collectable again


def test_disabled_collector_leaves_the_interpreter_alone():
    was = gc.isenabled()
    c = StepCollector(enabled=False)
    assert gc.isenabled() == was
    assert c.between_steps() == 0.0 and not c.frozen
    c.close()
    assert gc.isenabled() == was


def test_start_up_is_collected_and_frozen_before_the_first_step():
    """The first, full collection runs before step 1 (no update in flight); the first step's survivors are frozen
    after it as well, so a later collection walks only what was made since."""
    was = gc.isenabled()
    c = StepCollector()
    try:
        garbage = Node()
        ref = weakref.ref(garbage)
        del garbage
        assert c.before_first_step() >= 0.0 and c.frozen
        assert ref() is None  # start-up's cycles freed
        frozen = gc.get_freeze_count()
        made_in_step_1 = [Node() for _ in range(50)]
        c.between_steps()
        assert gc.get_freeze_count() >= frozen + len(made_in_step_1)  # step 1's survivors frozen too
        after_1 = gc.get_freeze_count()
        made_in_step_2 = [Node() for _ in range(50)]
        c.between_steps()
        assert gc.get_freeze_count() == after_1 and made_in_step_2  # later steps only collect
    finally:
        c.close()
    assert gc.isenabled() == was and gc.get_freeze_count() == 0
