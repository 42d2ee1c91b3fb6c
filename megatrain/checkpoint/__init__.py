"""Checkpoints: per-unit safetensors of the host store plus the run state, saved in the background, and resume.

Modules, one job each:
    layout.py      the on-disk layout; finding complete checkpoints; manifests and checksummed small files
    tensorfile.py  streaming safetensors writer/reader that hashes (sha256) the bytes as they pass
    saver.py       CheckpointSaver: background, consistent (before_update), atomic saves; keep the newest N
    resume.py      which checkpoint to resume, whether it fits, loading it into the store, metrics trimming
    state.py       run state (step, schedule, data position, RNG, config, versions); model/tokenizer files
    signals.py     SIGTERM/SIGINT: finish the step, save, exit 0
The Hugging Face export, which reads checkpoints, is export.py here.
"""

from .layout import complete_checkpoints, locate, newest_checkpoint, read_manifest, verify_checkpoint
from .resume import Resumed
from .saver import CheckpointSaver
from .signals import StopOnSignal

__all__ = ["CheckpointSaver", "Resumed", "StopOnSignal", "complete_checkpoints", "locate", "newest_checkpoint",
           "read_manifest", "verify_checkpoint"]
