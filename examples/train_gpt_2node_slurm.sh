#!/usr/bin/env bash
# Two nodes x 8 GPUs under SLURM: HSAP = Ulysses inside each node (NVLink),
# ring across the two nodes (InfiniBand), sequence-aware placement of documents.
#SBATCH --job-name=gpt-hsap
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
DATA=${DATA:?set DATA to an indexed dataset prefix, e.g. data/corpus_text_document}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes 2 --nproc-per-node 8 \
    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29500" \
    pretrain_gpt_hsap.py \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 \
    --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --disable-bias-linear \
    --seq-length 131072 --max-position-embeddings 131072 --position-embedding-type rope --rotary-base 500000 \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
    --context-parallel-size 16 --context-parallel-mode hsap --ulysses-size 8 --head-chunk-size 8 \
    --micro-batch-size 1 --global-batch-size 16 --train-iters 1000 \
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 --use-distributed-optimizer --recompute-granularity full \
    --data-path "$DATA" --split 99,1,0 --reset-attention-mask --eod-mask-loss \
    --save checkpoints/gpt_hsap_2node --load checkpoints/gpt_hsap_2node --save-interval 200 \
    --log-interval 10 "$@"
