"""Writes tests/data/det_expected_bits.json: for each type of forge.kernels.det_cases, the sha256 of the
deterministic product's bits by its numpy definition (forge.kernels.det_reference), which any host and
any build must reproduce.

    PYTHONPATH=. .venv/bin/python scripts/reference/make_det_bits.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from forge.kernels import det_cases, det_reference

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "det_expected_bits.json"


def main() -> None:
    bits = {}
    for qtype in det_cases.TYPES:
        data, x = det_cases.case(qtype)
        out = det_reference.matmul(x, data, qtype, (det_cases.ROWS, det_cases.COLS))
        bits[qtype.name] = hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest()
    OUT.write_text(json.dumps({"products": bits}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
