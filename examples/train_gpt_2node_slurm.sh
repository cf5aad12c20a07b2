#!/usr/bin/env bash
# Two nodes x 8 GPUs under SLURM: HSAP = Ulysses inside each node (NVLink),
# ring across the two nodes (InfiniBand), sequence-aware placement of documents.
#SBATCH --job-name=gpt-hsap
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
# DATA: an indexed dataset prefix from tools/preprocess_data.py. DRY_RUN=1 checks the flags for
# 16 ranks (8 per node) on any machine, without SLURM or GPUs (DATA may then be unset).
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
if [ -n "${DRY_RUN:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=${PYTHON:-.venv/bin/python}; fi
    launch=("${PYTHON:-python3}" pretrain_gpt_hsap.py --dry-run 16 --ranks-per-node 8)
else
    DATA=${DATA:?set DATA to an indexed dataset prefix, e.g. data/corpus_text_document}
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    launch=(srun torchrun --nnodes 2 --nproc-per-node 8
            --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29500"
            pretrain_gpt_hsap.py)
fi
"${launch[@]}" \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 \
    --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --disable-bias-linear \
    --seq-length 131072 --max-position-embeddings 131072 --position-embedding-type rope --rotary-base 500000 \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
    --context-parallel-size 16 --context-parallel-mode hsap --ulysses-size 8 --head-chunk-size 8 \
    --micro-batch-size 1 --global-batch-size 16 --train-iters 1000 \
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 --use-distributed-optimizer --recompute-granularity full \
    ${DATA:+--data-path "$DATA" --split 99,1,0} --reset-attention-mask --eod-mask-loss \
    --save checkpoints/gpt_hsap_2node --load checkpoints/gpt_hsap_2node --save-interval 200 \
    --log-interval 10 "$@"
