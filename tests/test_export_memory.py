"""Export streams: its peak host memory stays within one layer of the host store, on a model whose whole-model
copy would be several times that (measured as peak RSS in a fresh subprocess)."""

import json
import subprocess
import sys
import textwrap
import time

import torch
from transformers import AutoConfig

from megatrain.checkpoint import CheckpointSaver
from megatrain.checkpoint.resume import load_store, open_checkpoint
from megatrain.models import get_adapter
from megatrain.runtime.store import HostStore

MEASURE = textwrap.dedent("""
    import json, sys
    from megatrain.checkpoint.export import export_checkpoint

    def status(key):  # this process's own counters (ru_maxrss would include the parent's, inherited at fork)
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    small, big, out = sys.argv[1:4]
    export_checkpoint(small, out + "-warmup", dtype="fp32")  # every lazy import and first-call allocation
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    except OSError:
        pass
    before = status("VmRSS")
    res = export_checkpoint(big, out, dtype="fp32", max_shard_mb=100)
    print(json.dumps({"extra_bytes": status("VmHWM") - before, "seconds": res["seconds"], "bytes": res["bytes"]}))
""")


def save_random_checkpoint(path, layers: int, hidden: int, inter: int, vocab: int) -> tuple[int, int, float]:
    """A checkpoint of a random model, written by the real saver. Returns (params, largest layer, save seconds)."""
    cfg = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                               num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                               max_position_embeddings=256, tie_word_embeddings=False)
    adapter = get_adapter(cfg)
    store = HostStore(adapter, torch.float32)
    store.init_random(0, 0.02)
    saver = CheckpointSaver(path, store)
    t0 = time.perf_counter()
    saver.save(1, {"step": 1, "loader": {}, "rng": {}, "config": {}}, lambda d: cfg.to_json_file(d / "config.json"))
    saver.wait()
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_store(open_checkpoint(path / "step-1"), HostStore(adapter, torch.float32))  # the resume path, timed
    print(f"save {seconds:.2f}s, load with checksums {time.perf_counter() - t0:.2f}s "
          f"({store.num_params * 12 / 1e6:.0f} MB)")
    largest_layer = max(t.numel for t in store.tiles if t.unit.kind == "layer")
    return store.num_params, largest_layer, seconds


def test_export_peak_memory_is_within_one_layer_of_the_store(tmp_path):
    save_random_checkpoint(tmp_path / "small", layers=1, hidden=64, inter=128, vocab=256)
    params, layer, _ = save_random_checkpoint(tmp_path / "big", layers=8, hidden=512, inter=2048, vocab=4096)
    one_layer_of_store = 12 * layer  # fp32 master + Adam m + v (a bf16 run's store holds 14 B/param)
    whole_model_fp32 = 4 * params
    assert whole_model_fp32 > 3 * one_layer_of_store  # a whole-model copy could not hide under the bound
    r = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "small" / "step-1"),
                        str(tmp_path / "big" / "step-1"), str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"export of {params / 1e6:.1f}M params: {m['seconds']:.2f}s; peak extra host memory "
          f"{m['extra_bytes'] / 2**20:.1f} MiB; one layer of the store {one_layer_of_store / 2**20:.1f} MiB; "
          f"whole model in fp32 {whole_model_fp32 / 2**20:.1f} MiB")
    assert m["bytes"] == whole_model_fp32
    assert m["extra_bytes"] < one_layer_of_store
    # a checkpoint without generation_config.json or tokenizer still exports a loadable directory
    assert (tmp_path / "hf" / "generation_config.json").is_file()
