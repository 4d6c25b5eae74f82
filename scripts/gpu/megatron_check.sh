#!/usr/bin/env bash
# GPU check of miles-megatron (needs 2 GPUs: not run yet; the one H200 lent so far trained both backends on one rank, docs/how-to/megatron.md).
# On a host with 2+ CUDA GPUs and this repository's venv (CUDA torch, optional TransformerEngine):
#   bash scripts/gpu/megatron_check.sh
# It checks that no CPU patch is applied on GPU, then trains the tiny Qwen2 at TP=2 and the tiny
# Qwen2-MoE at EP=2 on NCCL for 2 steps and compares logprobs with an HF forward on the GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python - <<'PY'
import torch
assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
from miles_megatron.cpu_patches import apply_cpu_patches, applied_patches
assert apply_cpu_patches("cuda") == [] and applied_patches() == []
from miles_megatron.bridge import te_available
print("TransformerEngine:", te_available())
PY
out=$(mktemp -d)
cat > "$out/gpu_job.py" <<'PY'
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, "miles-megatron/tests")
import megatron_job as job

def rank_main(rank, world, model, options, port):
    from miles.precision.builtin import BF16
    from miles.training.trainer import DistContext
    from miles_megatron.settings import MegatronSettings
    from miles_megatron.trainer import MegatronTrainer
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    t = MegatronTrainer(job._train_settings(model), MegatronSettings(**options), BF16(None), DistContext(rank, world, rank, "cuda"))
    t.setup()
    vocab = job._vocab(model)
    lp = t.compute_logprobs(job.eval_batch(vocab).shard(rank, world), temperature=1.0)
    for s, b in enumerate(job.step_batches(vocab)[:2]):
        m = t.train_step(b.shard(rank, world), job.PolicyGradient(), temperature=1.0)
        if rank == 0: print(options, "step", s, m["loss"], m["grad_norm"])
    if rank == 0:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda()
        b = job.eval_batch(vocab).shard(0, world)
        worst = 0.0
        for toks, p, mine in zip(b.tokens, b.prompt_lengths, lp.logprobs):
            logits = hf(torch.tensor([toks]).cuda()).logits[0, p - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks[p:]).cuda()[:, None])[:, 0].cpu()
            worst = max(worst, float((ref - mine).abs().max()))
        print(options, "max |logprob - HF| (bf16)", worst)
        assert worst < 5e-2
    dist.barrier(); dist.destroy_process_group()

if __name__ == "__main__":
    model, options = sys.argv[1], eval(sys.argv[2])
    mp.spawn(rank_main, args=(2, model, options, 29711), nprocs=2, join=True)
PY
python -c "from miles.testing.models import build_tiny_model as b; b('$out/qwen2','qwen2',seed=4); b('$out/moe','qwen2_moe',seed=5)"
python "$out/gpu_job.py" "$out/qwen2" "{'tensor_parallel': 2, 'sequence_parallel': True}"
python "$out/gpu_job.py" "$out/moe" "{'expert_parallel': 2}"
echo "megatron GPU check passed"
