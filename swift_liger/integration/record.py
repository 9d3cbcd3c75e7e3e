"""The run's liger_patch.json in --output_dir: what was patched (swift_patches.py writes it at patch time) and what
ran (runtime.py adds the counters). Rank 0 writes; the file is replaced whole, never half-written."""
from __future__ import annotations

import json
import os

PATCH_FILE = "liger_patch.json"

records = {}  # output_dir -> liger_patch.json content


def write_record(output_dir, record) -> None:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, PATCH_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, default=str)
    os.replace(path + ".tmp", path)


def update_record(args, key, value) -> None:
    """Add `key: value` to this run's liger_patch.json (rank 0; the patch-time content stays as it is)."""
    output_dir = getattr(args, "output_dir", None)
    record = records.get(output_dir)
    if record is None:
        return
    record[key] = value
    write_record(output_dir, record)
