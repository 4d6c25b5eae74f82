"""HF -> Megatron -> HF for each family in one process (conversion is single-rank), plus the strict-key
errors of both directions; writes ``errors.json`` under ``--out``. Run by ``test_convert.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _error(fn: object, *args: str, **kwargs: str) -> str:
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except (KeyError, ValueError) as exc:
        return str(exc)
    raise AssertionError(f"{fn} accepted {args}")


def main() -> None:
    from miles_megatron.convert import hf_to_megatron, megatron_to_hf

    models, out = Path(sys.argv[1]), Path(sys.argv[2])
    for src in sorted(Path(models).iterdir()):
        if src.name.startswith("bad_"):
            continue
        hf_to_megatron(str(src), str(out / src.name / "megatron"))
        megatron_to_hf(str(out / src.name / "megatron"), str(out / src.name / "hf"))
    errors = {bad.name: _error(hf_to_megatron, str(bad), str(out / bad.name)) for bad in sorted(models.glob("bad_*"))}
    # Megatron -> HF with another model's config: a llama checkpoint (no QKV bias) read as Qwen2, and a
    # Qwen2 checkpoint read with one layer more
    llama = str(out / "llama" / "megatron")
    errors["wrong_family"] = _error(megatron_to_hf, llama, str(out / "x"), hf_config_dir=str(models / "qwen2"))
    deeper = out / "qwen2_3_layers"
    deeper.mkdir()
    config = json.loads((models / "qwen2" / "config.json").read_text())
    config.update(num_hidden_layers=3, layer_types=config["layer_types"][:1] * 3)
    (deeper / "config.json").write_text(json.dumps(config))
    qwen2 = str(out / "qwen2" / "megatron")
    errors["wrong_depth"] = _error(megatron_to_hf, qwen2, str(out / "y"), hf_config_dir=str(deeper))
    (out / "errors.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main()
