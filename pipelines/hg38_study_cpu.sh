#!/usr/bin/env bash
# The hg38 study's CPU twin: the cluster pipeline's stages at the mission's window sizes, on real
# human DNA (the shared hg38 chr2 piece, 2.33 Mbp), with the shipped tiny long-context model on 2
# ranks of this CPU. Only CLI calls: no logic lives here. Run end to end on 2 cores with 24 GiB
# (2026-12-06, while other jobs shared the machine for its first 40 minutes): 1 h 12 min in all;
# training 20 min (two 512k steps, 7,084 MiB at most on a rank, 6.39 GiB planned for the step's
# tensors); eval 51 min (the 1M window, tuned model and its start, 9,028 MiB at most on a rank,
# 9.20 GiB planned as an upper bound); prepare, plan and export seconds each.
#   usage: pipelines/hg38_study_cpu.sh [fasta] [out-folder]
set -euo pipefail
FASTA=${1:-../shared/data/genomes/hg38_chr2_1-2333275.fa.gz}
OUT=${2:-data/twin}

# 1M-token windows: the first 1.28 Mbp for training (cropped to 512k-token sequences), the last
# 1,048,576 bases held out as one 1M window.
genome-lm prepare --fasta "$FASTA" --out "$OUT/prepared" --train-chroms chr2:1-1,284,699 \
  --eval-chroms chr2:1,284,700-2,333,275 --window 1M

# How much host memory a rank needs at 512k (context parallel 2, full recompute), before training.
genome-lm plan --config hg38-twin-cpu --device cpu --gpus 2

# Two steps of two 512k-token sequences, context parallel over 2 Ray workers.
genome-lm finetune --config hg38-twin-cpu --set data.dataset="$OUT/prepared" --set train.out_dir="$OUT/run" \
  --ray-address local --workers 2 --quiet

# The 1M window, the tuned model against its start, each window split over the 2 ranks by context
# parallel; buckets by preceding context up to 1M.
genome-lm eval --model "$OUT/run" --baseline init --out "$OUT/eval" --set parallel.cp=2 \
  --ray-address local --workers 2 --quiet

# The tuned weights as a Hugging Face folder, in one process from the 2 ranks' checkpoint pieces.
genome-lm export --run "$OUT/run" --out "$OUT/export"
