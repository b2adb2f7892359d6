#!/usr/bin/env bash
# The published study on hg38, stage by stage. Only CLI calls: no logic lives here.
#   usage: pipelines/hg38_study.sh /path/to/hg38.fa[.gz] [out-folder] [config]
# Run it on the head node of a Ray cluster with 64 GPUs (RAY_ADDRESS=auto), with the
# GLM-5.3-Flash checkpoint at checkpoints/GLM-5.3-Flash. `genome-lm plan --config CONFIG --eval`
# says how many GPUs the eval stage needs and how long it takes.
set -euo pipefail
FASTA=${1:?usage: $0 hg38.fa [out-folder] [config]}
OUT=${2:-data/hg38}
CONFIG=${3:-glm-5.3-flash-512k-64xb200}

# chr1 + chr2 for training, chr22 for evaluation, 512k-token windows.
genome-lm prepare --fasta "$FASTA" --out "$OUT/prepared" --train-chroms chr1,chr2 --eval-chroms chr22 --window 512k

# 80 steps at 512k tokens per sequence on 64 GPUs (one Ray actor per GPU).
genome-lm finetune --config "$CONFIG" --set data.dataset="$OUT/prepared" --set train.out_dir="$OUT/run" \
  --ray-address "${RAY_ADDRESS:-auto}" --workers 64 --cpus-per-worker 8

# Loss by preceding context on chr22: the tuned model against its start (the pretrained weights,
# loaded under the eval layout), and against itself with its context cut to 1k and 16k. On the
# same 64 GPUs, in the run's layout (or --set parallel.* with the layout plan --eval names).
genome-lm eval --model "$OUT/run" --baseline init --chrom chr22 --max-context 1k,16k --out "$OUT/eval-chr22" \
  --ray-address "${RAY_ADDRESS:-auto}" --workers 64 --cpus-per-worker 8

# The tuned weights as a Hugging Face glm5_next folder: one process on the head node, streamed
# tensor by tensor from the 64 ranks' checkpoint pieces (no GPU, no model built).
genome-lm export --run "$OUT/run" --out "$OUT/export"
