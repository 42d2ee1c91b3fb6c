"""While I/O threads move data the GIL's switch interval is short (runtime/gil.py): set by the first pool, kept
while any is open, the process's own interval restored when the last closes."""

import sys

import pytest
import torch

from megatrain.checkpoint.fastio import Pool
from megatrain.runtime import gil


@pytest.fixture
def interval():
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    yield 0.004
    sys.setswitchinterval(old)


def test_nested_and_overlapping_users_restore_the_interval(interval):
    a, b = gil.short_switches(), gil.short_switches()
    a.__enter__()
    assert sys.getswitchinterval() == pytest.approx(gil.SWITCH_S)
    b.__enter__()
    a.__exit__(None, None, None)  # the first out while the second is open: still short
    assert sys.getswitchinterval() == pytest.approx(gil.SWITCH_S)
    b.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_a_shorter_interval_of_the_process_is_kept(interval):
    sys.setswitchinterval(gil.SWITCH_S / 2)
    with gil.short_switches():
        assert sys.getswitchinterval() == pytest.approx(gil.SWITCH_S / 2)
    assert sys.getswitchinterval() == pytest.approx(gil.SWITCH_S / 2)


def test_an_io_pool_shortens_it_for_its_life_even_on_an_error(interval):
    with Pool(2) as pool:
        assert sys.getswitchinterval() == pytest.approx(gil.SWITCH_S)
        pool.submit(lambda: None).result()
    assert sys.getswitchinterval() == pytest.approx(interval)
    with pytest.raises(ValueError):
        with Pool(2):
            raise ValueError("a task failed")
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_the_weights_load_shortens_it_while_reading(interval, tmp_path, monkeypatch):
    from conftest import make_model_dir
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.runtime import weights_load
    from megatrain.runtime.store import HostStore

    seen = []
    real = weights_load.ThreadPoolExecutor

    class Spy(real):
        def submit(self, *a, **k):
            seen.append(sys.getswitchinterval())
            return super().submit(*a, **k)

    monkeypatch.setattr(weights_load, "ThreadPoolExecutor", Spy)
    make_model_dir(tmp_path / "model", "qwen2", seed=1)
    store = HostStore(get_adapter(load_hf_config(tmp_path / "model")), torch.bfloat16)
    store.load_safetensors(tmp_path / "model", threads=2, progress=False)
    assert seen and all(x == pytest.approx(gil.SWITCH_S) for x in seen)
    assert sys.getswitchinterval() == pytest.approx(interval)
