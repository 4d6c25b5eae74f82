"""HF -> Megatron -> HF for each family in one process (conversion is single-rank), plus the strict-key
errors; writes ``errors.json`` under ``--out``. Run by ``test_convert.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    from miles_megatron.convert import hf_to_megatron, megatron_to_hf

    models, out = sys.argv[1], Path(sys.argv[2])
    for src in sorted(Path(models).iterdir()):
        if src.name.startswith("bad_"):
            continue
        hf_to_megatron(str(src), str(out / src.name / "megatron"))
        megatron_to_hf(str(out / src.name / "megatron"), str(out / src.name / "hf"))
    errors = {}
    for bad in sorted(Path(models).glob("bad_*")):
        try:
            hf_to_megatron(str(bad), str(out / bad.name))
        except KeyError as exc:
            errors[bad.name] = str(exc)
    (out / "errors.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main()
