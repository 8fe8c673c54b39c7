#!/usr/bin/env bash
# The product end to end on one GPU: the trainer under a private Ray instance, actor and HF engine colocated
# on the GPU, a few GRPO steps of the built-in task, a checkpoint, a resume from it, the exported model loaded
# back and asked a question. Needs a CUDA machine with ray, torch and transformers; the repository is the
# working directory (cloudrl installed, or this checkout on PYTHONPATH through a cloudrl/ folder of links).
#   bash bench/gpu_e2e.sh [RUN_DIR]           # ~2 minutes; exits non-zero at the first step that fails
set -euo pipefail
run_dir=${1:-/tmp/cloudrl-gpu-e2e}
rm -rf "$run_dir"
gpus=${GPUS:-1}   # GPUS=0: the same run on CPU (a rehearsal of this script)
common=(--preset local algorithm.name=grpo "actor.gpus_per_node=$gpus" "placement.colocate_all=$([ "$gpus" = 0 ] && echo false || echo true)"
        "model.dtype=$([ "$gpus" = 0 ] && echo float32 || echo bfloat16)" model.sft_warmup_steps=30 trainer.save_every=3 trainer.val_every=3
        "trainer.run_dir=$run_dir")

echo "== train 6 steps, checkpoint every 3"
start=$(date +%s)
timeout 300 python3 -m cloudrl.trainer "${common[@]}" trainer.total_steps=6
echo "first run: $(( $(date +%s) - start )) s"

echo "== resume from step 6 to step 9"
start=$(date +%s)
timeout 300 python3 -m cloudrl.trainer "${common[@]}" trainer.total_steps=9
echo "resumed run: $(( $(date +%s) - start )) s"
grep -c '"step"' "$run_dir/metrics.jsonl" | sed 's/^/metrics lines: /'

echo "== the exported model, loaded back on the GPU"
python3 - "$run_dir/hf_model" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
ids = tok("2+2=", return_tensors="pt").to(device)
out = model.generate(**ids, max_new_tokens=3, do_sample=False)
print("export loads on", torch.cuda.get_device_name() if device == "cuda" else "cpu", "and answers:", repr(tok.decode(out[0])))
EOF
