#!/usr/bin/env bash
# GPU check of miles-sglang (NOT RUN YET: written without a GPU at hand; SGLang has never run under Miles).
#
# On a CUDA host with this repository's venv (miles-core, miles-fsdp, miles-sglang installed):
#   bash scripts/gpu/sglang_check.sh            # MODEL=/path/or/hub-id to train a real checkpoint
# It installs SGLang 0.5.23 and smg if they are missing (that needs the package index: SGLang brings its
# own CUDA torch), then runs GRPO through miles train with miles-fsdp on real SGLang engines:
#   A. 2+ GPUs: 10 steps, trainer on GPU 0, one SGLang engine on GPU 1 behind smg, weights over NCCL
#      (transport broadcast), every push verified by sampled tensors (/get_weights_by_name);
#   B. any GPU count: 3 steps colocated on GPU 0 (memory saver, release/resume around training),
#      weights by CUDA IPC (transport sglang_tensor), verified the same way;
#   C. any GPU count: 3 LoRA steps colocated on GPU 0 (miles-lora: train.adapter r=8, an engine launched with
#      --enable-lora --max-lora-rank 8 --lora-target-modules ...), each push an adapter directory loaded with
#      /load_lora_adapter after /unload_lora_adapter, verified by /v1/models, rollouts sent with lora_path.
# The default model is a randomly initialised ~0.5B Llama built here (SGLang 0.5.23 implements
# /get_weights_by_name for Llama, not for Qwen2), with Miles' in-process tokenizer: nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false
python -c "import sglang" 2>/dev/null || python -m pip install "sglang==0.5.23"
command -v smg >/dev/null || python -m pip install "smg==1.13.0"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -ge 1 ] || { echo "no CUDA GPU visible"; exit 1; }
out=$(mktemp -d)
echo "work dir $out, $gpus GPU(s)"

model=${MODEL:-}
if [ -z "$model" ]; then
  model="$out/llama-0.5b"
  python - "$model" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from miles.testing.models import CHATML_TEMPLATE, build_tokenizer
tok = build_tokenizer(512)
tok.chat_template = CHATML_TEMPLATE
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=1536, intermediate_size=4096, num_hidden_layers=20,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
torch.manual_seed(0)
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
print("parameters:", sum(p.numel() for p in m.parameters()) / 1e9, "B")
m.save_pretrained(sys.argv[1], safe_serialization=True); tok.save_pretrained(sys.argv[1])
PY
fi

python - "$out/prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for a in range(2, 12):
        for b in range(2, 12):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b)}) + "\n")
PY

config() {  # $1 run dir, $2 steps, $3 colocate, $4 transport, $5 router, $6 extra TOML (optional)
  cat > "$1.toml" <<EOF
[cluster]
device = "cuda"
trainer_ranks = 1
num_engines = 1
colocate = $3

[data]
path = "$out/prompts.jsonl"

[rollout]
rollout_batch_size = 8
n_samples_per_prompt = 4
max_new_tokens = 32
temperature = 1.0
router = "$5"

[rollout.engine]
name = "sglang"
mem_fraction_static = 0.4
log_level = "warning"

[train]
model_path = "$model"
num_rollouts = $2
global_batch_size = 16
lr = 1e-6

[algorithm]
name = "grpo"

[[reward.functions]]
name = "math"

[transport]
name = "$4"
verify = true

[precision]
name = "bf16"

[log]
run_dir = "$1"
${6:-}
EOF
}

check() {  # $1 run dir, $2 steps
  python - "$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
assert [r["step"] for r in rows] == list(range(1, int(sys.argv[2]) + 1)), [r["step"] for r in rows]
for r in rows:
    assert r["weight_sync/verified"] == 1.0, r
    assert r.get("weight_sync/verified_tensors", 0) > 0 or r.get("weight_sync/verified_adapters", 0) > 0, r
    print(f"step {r['step']:2d}  reward {r.get('rollout/reward_mean', float('nan')):.3f}  "
          f"|train-rollout| {r['fidelity/train_rollout_logprob_abs_diff']:.4f}  "
          f"cache hit {r['rollout/prefix_cache_hit_rate']:.2f}  push {r['weight_sync/seconds']:.2f}s  "
          f"pushed {int(r['weight_sync/tensors'])} tensors")
    assert r["fidelity/train_rollout_logprob_abs_diff"] < 0.1, "engine and trainer disagree (bf16)"
PY
}

if [ "$gpus" -ge 2 ]; then
  config "$out/broadcast" 10 false broadcast smg
  miles train "$out/broadcast.toml"
  check "$out/broadcast" 10
  echo "A. 10 GRPO steps, SGLang behind smg, NCCL broadcast, verified: passed"
else
  echo "A. skipped: needs 2 GPUs (NCCL cannot join two ranks on one GPU)"
fi
config "$out/ipc" 3 true sglang_tensor none
miles train "$out/ipc.toml"
check "$out/ipc" 3
echo "B. 3 GRPO steps colocated, CUDA IPC (sglang_tensor), verified: passed"
python -c "import miles_lora" 2>/dev/null || python -m pip install -e miles-lora
lora='[train.adapter]
name = "lora"
r = 8
alpha = 16'
config "$out/lora" 3 true lora none "$lora"
sed -i 's/^lr = 1e-6$/lr = 1e-4/' "$out/lora.toml"  # LoRA takes larger steps
miles train "$out/lora.toml"
check "$out/lora" 3
[ -d "$out/lora/lora/policy-v3" ] || { echo "no adapter directory of version 3"; exit 1; }
echo "C. 3 LoRA GRPO steps on SGLang (adapter-only pushes, /load_lora_adapter), verified: passed"
echo "sglang GPU check passed"
