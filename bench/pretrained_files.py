"""A model folder's pretrained weights for a load benchmark: random bf16 safetensors, sharded as Hugging Face
publishes them (model-0000k-of-0000n.safetensors of at most --shard-gb, model.safetensors.index.json), with the
tensor names and shapes transformers gives the config (built on the meta device), tied embeddings without
lm_head.weight. The values are slices of one random pool (normal, std 0.02): what a load measures is bytes.

    from pretrained_files import write_weights, evict
    nbytes = write_weights(model_dir)       # beside model_dir/config.json
    evict(model_dir)                        # their pages out of the page cache: the next read is the disk's
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

POOL = 64 << 20  # elements of the random pool (128 MiB of bf16)


def tensor_shapes(model_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a checkpoint of this config holds, in the model's order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    tied = getattr(cfg, "tie_word_embeddings", False)
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]


def write_weights(model_dir: Path, shard_gb: float = 5.0, seed: int = 0) -> int:
    """Writes the shards and their index into model_dir (config.json there); returns the bytes of tensors. Shards
    an earlier call wrote for the same tensors (the index's names and total, every file there) are kept."""
    from safetensors.torch import save_file

    from megatrain.checkpoint.export import plan_shards

    shapes = tensor_shapes(model_dir)
    expected = sum(2 * torch.Size(s).numel() for _, s in shapes)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        old = json.loads(index.read_text())
        if old["metadata"]["total_size"] == expected and set(old["weight_map"]) == {n for n, _ in shapes} and \
                all((model_dir / f).is_file() for f in set(old["weight_map"].values())):
            return expected
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=g) * 0.02).to(torch.bfloat16)
    shards = plan_shards(shapes, 2, int(shard_gb * 1e9))  # as an export shards them
    where, total, pos = {}, 0, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            numel = torch.Size(shape).numel()
            t = torch.empty(numel, dtype=torch.bfloat16)
            done = 0
            while done < numel:  # the pool's slices, from where the last tensor stopped
                m = min(numel - done, POOL - pos)
                t[done: done + m] = pool[pos: pos + m]
                done, pos = done + m, (pos + m) % POOL
            tensors[name] = t.view(shape)
            where[name] = fname
            total += 2 * numel
        save_file(tensors, str(model_dir / fname), metadata={"format": "pt"})
        del tensors
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": where}, indent=2))
    return total


def evict(folder: Path) -> None:
    """Drop a folder's clean pages from the page cache (no root needed): the next read comes from the disk."""
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
