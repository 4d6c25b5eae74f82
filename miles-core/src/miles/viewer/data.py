"""What the viewer shows, read from a run directory: ``metrics.jsonl``, ``samples/rollout_<step>.jsonl``
and, when recorded, ``samples/trainer_logprobs_<step>.jsonl`` (``log.trainer_logprobs``). Token ids are
decoded one by one with the run's tokenizer (the model directory named in ``settings.json``), or shown as
ids when it is gone."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

from miles.types import Sample

__all__ = ["RunData"]

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^rollout_(\d+)\.jsonl$")


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


class RunData:
    """Read-only access to one run directory (re-read on every call: a run may still be writing)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise FileNotFoundError(f"{run_dir}: no such run directory")
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        self._pieces: dict[int, str] = {}

    # -- the tokenizer ------------------------------------------------------------------------------------
    def model_path(self) -> str | None:
        settings = self.run_dir / "settings.json"
        if not settings.exists():
            return None
        value = json.loads(settings.read_text()).get("train", {}).get("model_path")
        return str(value) if value else None

    def tokenizer(self) -> Any:
        if not self._tokenizer_loaded:
            self._tokenizer_loaded = True
            path = self.model_path()
            if path and (Path(path) / "config.json").exists():
                try:
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(path)
                except Exception as exc:  # a broken model folder: show ids
                    log.warning("cannot load the tokenizer of %s (%s): showing token ids", path, exc)
        return self._tokenizer

    def piece(self, token: int) -> str:
        """The text of one token id (decoded alone; cached)."""
        if token not in self._pieces:
            tokenizer = self.tokenizer()
            self._pieces[token] = (
                f"[{token}]"
                if tokenizer is None
                else str(tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False))
            )
        return self._pieces[token]

    # -- steps and metrics --------------------------------------------------------------------------------
    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line being written
        return rows

    def steps(self) -> list[int]:
        folder = self.run_dir / "samples"
        if not folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name)))

    def summary(self) -> dict[str, Any]:
        metrics = {int(r["step"]): r for r in self.metrics() if "step" in r}
        steps = []
        for step in self.steps():
            row = metrics.get(step, {})
            steps.append(
                {
                    "step": step,
                    "reward_mean": _finite(row.get("rollout/reward_mean")),
                    "logprob_diff": _finite(row.get("fidelity/train_rollout_logprob_abs_diff")),
                    "has_trainer_logprobs": (self.run_dir / "samples" / f"trainer_logprobs_{step:06d}.jsonl").exists(),
                }
            )
        curves: dict[str, list[list[float]]] = {}
        for key in ("rollout/reward_mean", "fidelity/train_rollout_logprob_abs_diff", "train/loss", "eval/reward_mean"):
            points = [[float(r["step"]), v] for r in metrics.values() if (v := _finite(r.get(key))) is not None]
            if points:
                curves[key] = points
        return {"run_dir": str(self.run_dir), "model": self.model_path(), "steps": steps, "curves": curves}

    # -- one step ------------------------------------------------------------------------------------------
    def _trainer_logprobs(self, step: int) -> dict[tuple[int, int], list[float]]:
        path = self.run_dir / "samples" / f"trainer_logprobs_{step:06d}.jsonl"
        if not path.exists():
            return {}
        out = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            out[(int(row["group_id"]), int(row["index"]))] = [float(v) for v in row["logprobs"]]
        return out

    def _tokens(self, sample: Sample, trainer: list[float] | None) -> list[dict[str, Any]]:
        tokens = []
        for i, token in enumerate(sample.response_ids):
            entry: dict[str, Any] = {"t": self.piece(token), "id": token, "m": sample.loss_mask[i]}
            entry["lp"] = sample.rollout_logprobs[i]
            if trainer is not None and len(trainer) == len(sample.response_ids):
                entry["tlp"] = trainer[i]
            tokens.append(entry)
        return tokens

    @staticmethod
    def _turns(tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The response as alternating spans: the policy's (trained) and the environment's (masked)."""
        turns: list[dict[str, Any]] = []
        for token in tokens:
            who = "policy" if token["m"] else "environment"
            if not turns or turns[-1]["by"] != who:
                turns.append({"by": who, "tokens": []})
            turns[-1]["tokens"].append(token)
        return turns

    def step(self, step: int) -> dict[str, Any]:
        path = self.run_dir / "samples" / f"rollout_{step:06d}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no samples for step {step}")
        trainer = self._trainer_logprobs(step)
        groups: dict[int, list[dict[str, Any]]] = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            sample = Sample.from_json(line)
            tokens = self._tokens(sample, trainer.get((sample.group_id, sample.index)))
            groups.setdefault(sample.group_id, []).append(
                {
                    "group_id": sample.group_id,
                    "index": sample.index,
                    "reward": sample.reward,
                    "reward_parts": sample.reward_parts,
                    "status": sample.status.value,
                    "status_reason": sample.status_reason,
                    "label": None if sample.label is None else str(sample.label),
                    "weight_versions": [w.to_list() for w in sample.weight_versions],
                    "prompt": "".join(self.piece(t) for t in sample.prompt_ids),
                    "turns": self._turns(tokens),
                    "masked_tokens": sum(1 for t in tokens if not t["m"]),
                }
            )
        return {
            "step": step,
            "has_trainer_logprobs": bool(trainer),
            "groups": [{"group_id": g, "samples": samples} for g, samples in sorted(groups.items())],
        }
