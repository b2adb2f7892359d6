#!/usr/bin/env bash
# The published study on hg38, stage by stage. Only CLI calls: no logic lives here.
#   usage: pipelines/hg38_study.sh /path/to/hg38.fa[.gz] [out-folder]
# The finetune and eval stages are added here as those commands land.
set -euo pipefail
FASTA=${1:?usage: $0 hg38.fa [out-folder]}
OUT=${2:-data/hg38}

# chr1 + chr2 for training, chr22 for evaluation, 512k-token windows.
genome-lm prepare --fasta "$FASTA" --out "$OUT/prepared" --train-chroms chr1,chr2 --eval-chroms chr22 --window 512k
