"""The frozen reference's weight files, identified, so that a resumed run streams the weights it started from.

A run that keeps a frozen reference copy in the store (preference.reference: stream; grpo with grpo.beta > 0)
loads the step-0 weights again when it resumes, from their files (model.path, or preference.reference_path): the
checkpoint holds only the policy. If those files were replaced since, the run would go on against another model's
log-probs without a word. So each file's identity (name, size, and a hash of its header and of SAMPLES blocks of
SAMPLE_BYTES spread evenly over its data) goes into the checkpoint's run state, and a resume whose files differ is
refused by name before anything is written. Sampled, not whole: other or re-saved weights change nearly every block,
and hashing 15-240 GB would cost a full read at every start; a copied or moved folder keeps its identity.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from ..errors import MegatrainError

SAMPLES = 16
SAMPLE_BYTES = 1 << 16


def weights_identity(folder: Path) -> dict[str, str]:
    """{safetensors file name: "size:hash"} of a model folder's weight files."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        size = f.stat().st_size
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = min(struct.unpack("<Q", head)[0], size) if len(head) == 8 else 0
            h.update(head + fh.read(n))
            start, span = 8 + n, max(size - 8 - n - SAMPLE_BYTES, 0)
            for k in range(SAMPLES):
                fh.seek(start + span * k // (SAMPLES - 1))
                h.update(fh.read(SAMPLE_BYTES))
        out[f.name] = f"{size}:{h.hexdigest()[:16]}"
    return out


def check_reference_weights(folder: Path, resumed) -> dict[str, str]:
    """The identity of the reference's weight files in `folder`; on a resume, refused where it is not the one the
    checkpoint recorded (a checkpoint written before the identity was recorded is taken as it is)."""
    now = weights_identity(folder)
    then = (resumed.state.get("reference") or {}).get("weights") if resumed is not None else None
    if isinstance(then, dict) and then != now:
        name = next(k for k in sorted(then.keys() | now.keys()) if then.get(k) != now.get(k))
        what = "is gone" if name not in now else "is new" if name not in then else "has other contents"
        raise MegatrainError(f"resume: the reference weights in {folder} are not those checkpoint {resumed.path} "
                             f"was trained against ({name} {what}); the frozen reference is the step-0 model, "
                             f"loaded again from these files: put them back, or start the run over "
                             f"(output.overwrite=true)")
    return now
