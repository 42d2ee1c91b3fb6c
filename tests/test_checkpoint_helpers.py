"""Builders shared by the checkpoint, resume and export tests (no tests here): a tiny model with a tokenizer, a
data file and a config for a real trainer run, plus readers of what a run leaves behind."""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml

from conftest import make_model_dir

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def make_model_with_tokenizer(path: Path, family: str = "llama", tied: bool = False, **kw) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_model_dir(path, family, tied=tied, **kw)
    vocab = {c: i for i, c in enumerate(["<pad>", "<s>", "</s>"] + list("abcdefghijklmnopqrstuvwxyz "))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return Path(path)


def make_data(path: Path, n: int = 48, seed: int = 0) -> Path:
    """Texts of unequal lengths, so packing puts several documents in a row."""
    r = random.Random(seed)
    path.write_text("".join(json.dumps({"text": "".join(r.choice("abcdefgh ") for _ in range(r.randint(3, 20)))})
                            + "\n" for _ in range(n)))
    return path


def write_config(path: Path, model_dir: Path, data_file: Path, out: Path, cache: Path, **sections) -> Path:
    cfg = {
        "model": {"path": str(model_dir)},
        "data": {"path": str(data_file), "format": "text", "max_seq_len": 32, "packing": True, "cache_dir": str(cache)},
        "train": {"steps": 6, "micro_batch_size": 2, "grad_accum_steps": 2, "precision": "fp32", "lr": 1e-3,
                  "weight_decay": 0.1, "warmup_steps": 2},
        "output": {"dir": str(out)},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    path.write_text(yaml.safe_dump(cfg))
    return path


def setup_run(tmp_path: Path, family: str = "llama", tied: bool = False, **sections) -> Path:
    """A model dir, data and config under tmp_path; returns the config file (output.dir = tmp_path/run)."""
    model = make_model_with_tokenizer(tmp_path / "model", family, tied)
    data_file = make_data(tmp_path / "train.jsonl")
    return write_config(tmp_path / "cfg.yaml", model, data_file, tmp_path / "run", tmp_path / "cache", **sections)


def run(cfg_path: Path, *overrides: str) -> dict:
    from megatrain.config import load_config
    from megatrain.run.trainer import train

    return train(load_config(cfg_path, list(overrides)))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, float]:
    """step -> loss; fails on a duplicate step."""
    got = {}
    for r in records(out):
        if "loss" in r:
            assert r["step"] not in got, f"step {r['step']} logged twice"
            got[r["step"]] = r["loss"]
    return got


def unit_hashes(ckpt: Path) -> dict[str, str]:
    """The sha256 of each unit file (one per file, or one per chunk): equal hashes = bit-identical master, Adam m and
    v and step of every unit."""
    m = json.loads((Path(ckpt) / "manifest.json").read_text())
    return {u["file"]: str(m["files"][u["file"]].get("sha256_chunks", m["files"][u["file"]].get("sha256")))
            for u in m["units"]}


def full_disk_after(monkeypatch, writes: int) -> None:
    """The checkpoint pool's write call (fastio.transfer) fails with ENOSPC after `writes` successful writes, as a
    disk that fills up mid-save does."""
    from megatrain.checkpoint import fastio

    calls, original = [], fastio.transfer

    def full_disk(*a, **kw):
        calls.append(1)
        if len(calls) > writes:
            raise OSError(28, "No space left on device")
        return original(*a, **kw)

    monkeypatch.setattr(fastio, "transfer", full_disk)
