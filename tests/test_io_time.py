"""planner/io_time.py: the pretrained files' bytes the load estimate reads (gpt-oss's MXFP4 experts at their packed
size, the size of the real files), and the operations' seconds from the disk's rates."""

import pytest
import torch
from safetensors import safe_open

from conftest import make_model_dir
from megatrain.models import get_adapter, load_hf_config
from megatrain.planner.calibration import IO_EFFICIENCY
from megatrain.planner.io_time import io_times, load_bytes
from test_gpt_oss import mxfp4_model_dir


def file_bytes(folder) -> tuple[int, set]:
    """The tensor bytes of a model folder's safetensors, and their dtypes."""
    total, dtypes = 0, set()
    for p in folder.glob("*.safetensors"):
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                n = 1
                for s in t.get_shape():
                    n *= s
                dt = {"F32": torch.float32, "BF16": torch.bfloat16, "U8": torch.uint8}[t.get_dtype()]
                total += n * dt.itemsize
                if dt != torch.uint8:
                    dtypes.add(dt)
    return total, dtypes


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16-or-fp32", "mxfp4"])
def test_load_bytes_are_the_files_bytes(tmp_path, mxfp4):
    if mxfp4:
        mxfp4_model_dir(tmp_path, seed=5)
    else:
        make_model_dir(tmp_path, "gpt_oss", seed=5)
    adapter = get_adapter(load_hf_config(tmp_path))
    size, dtypes = file_bytes(tmp_path)
    (dtype,) = dtypes
    got = load_bytes(adapter, str(dtype).replace("torch.", ""))
    assert got == size
    params = sum(u.numel for u in adapter.units())
    assert (got < params * dtype.itemsize) == mxfp4
    assert load_bytes(adapter, None) == 0


def test_io_times_from_the_disks_rates():
    params, read, write = 10**9, 2e9, 1e9
    io = io_times(params, read, write, step_s=10.0, every=50, file_dtype="bfloat16", file_bytes=7 * 10**8)
    assert io["load_bytes"] == 7 * 10**8 and io["load_s"] == pytest.approx(0.7 / (2 * IO_EFFICIENCY["load"]))
    assert io_times(params, read, write, 10.0, file_dtype="float32")["load_s"] == \
        pytest.approx(4 / (2 * IO_EFFICIENCY["load"]))
    assert io_times(params, read, write, 10.0, file_dtype=None)["load_s"] == 0.0
    assert io["save_cost_s"] == pytest.approx(max(0.0, io["save_s"] - 10.0))
