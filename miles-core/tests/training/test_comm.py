"""The collectives between trainer ranks, on a real 2-rank gloo group: tensors travel as tensors (exact,
any dtype and shape), control values as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from miles.net import free_port

JOB = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from miles.training.batch import TrainBatch
    from miles.training.comm import (
        all_gather_json, all_gather_rows, all_gather_tensors, all_reduce_sum, broadcast_json, broadcast_tensors,
    )
    from miles.training.step_metrics import StepMetrics, count_step

    def main(rank: int, port: int, out: str) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        batch = TrainBatch.from_lists(
            tokens=[[1, 2, 3], [4, 5, 6, 7]], prompt_lengths=[1, 2], loss_mask=[[1, 0], [1, 1]],
            advantages=[[0.5, -1.25], [3.0, 1e-30]],
            teacher_topk_ids=[[[1, 2], [3, 4]], [[5, 6], [7, 8]]],
            teacher_topk_logprobs=[[[-0.1, -2.0], [-0.3, -1.5]], [[-0.2, -0.9], [-0.05, -3.0]]],
        )
        got = TrainBatch.from_tensors(broadcast_tensors(batch.to_tensors() if rank == 0 else None))
        same = all(torch.equal(getattr(got, k), v) for k, v in batch.to_tensors().items())
        experts = torch.tensor([[[-1, 300], [7, 32767]]], dtype=torch.int16)  # gloo has no int16: sent as bytes
        sent = broadcast_tensors({"routed": experts} if rank == 0 else None)["routed"]
        int16_exact = sent.dtype == torch.int16 and torch.equal(sent, experts)
        pooled16 = all_gather_tensors({"routed": experts[:, : rank + 1] + rank, "flags": torch.tensor([True, rank == 1])})
        int16_exact = int16_exact and all(
            p["routed"].dtype == torch.int16 and torch.equal(p["routed"], experts[:, : r + 1] + r)
            and torch.equal(p["flags"], torch.tensor([True, r == 1]))
            for r, p in enumerate(pooled16)
        )
        mine = batch.shard(rank, 2)
        pooled = TrainBatch.concat([TrainBatch.from_tensors(t) for t in all_gather_tensors(mine.to_tensors())])
        pooled_same = all(torch.equal(getattr(pooled, k), v) for k, v in batch.to_tensors().items())
        rows = all_gather_rows(torch.arange(rank + 2, dtype=torch.float64) + 10 * rank, [2, 3])
        cpu = torch.device("cpu")
        counts = count_step(mine.loss_mask, len(mine), mine.num_tokens, seq_len_norm=1.0, device=cpu)
        sums = StepMetrics(cpu)  # each rank logs a metric the other does not
        sums.add_loss(torch.tensor(1.5 + rank))
        sums.add("kl" if rank == 0 else "entropy", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0]))
        result = {
            "broadcast_exact": same,
            "int16_exact": int16_exact,
            "pooled_exact": pooled_same,
            "rows": rows.tolist(),
            "json": broadcast_json({"step": 3, "rank": rank}),
            "gathered": all_gather_json(rank * 2),
            "summed": all_reduce_sum(torch.tensor([rank + 1.0])).tolist(),
            "counts": [counts.denominators.num_tokens, counts.denominators.num_sequences, counts.tokens],
            "metrics": sums.reduce(counts.denominators.num_tokens, cpu),
        }
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        port, out = int(sys.argv[1]), sys.argv[2]
        mp.spawn(main, args=(port, out), nprocs=2)
    """
)


def test_tensors_and_json_cross_two_gloo_ranks_exactly(tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "result"
    proc = subprocess.run(
        [sys.executable, str(script), str(port), str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result.{rank}").read_text())
        assert result["broadcast_exact"] and result["pooled_exact"] and result["int16_exact"]
        assert result["rows"] == [0.0, 1.0, 10.0, 11.0, 12.0]
        assert result["json"] == {"step": 3, "rank": 0}
        assert result["gathered"] == [0, 2]
        assert result["summed"] == [3.0]
        assert result["counts"] == [3, 2, 7.0]  # trained tokens, sequences, tokens of both ranks
        assert result["metrics"] == {"loss": 4.0, "entropy": 1 / 3, "kl": 1 / 3}
