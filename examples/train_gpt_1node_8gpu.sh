#!/usr/bin/env bash
# One node, 8 GPUs (NCCL): a 1B-class GPT with 64K-token packed sequences,
# HSAP context parallelism over all 8 GPUs (Ulysses 8, head chunks of 8).
# DATA: an indexed dataset prefix from tools/preprocess_data.py; unset, the job trains on the
# embedded stdlib corpus. DRY_RUN=1 checks the flags for 8 ranks on any machine (no GPU) and
# prints the resolved configuration and the predicted memory per GPU instead of training.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${DRY_RUN:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=${PYTHON:-.venv/bin/python}; fi
    launch=("${PYTHON:-python3}" pretrain_gpt_hsap.py --dry-run 8)
else
    launch=(torchrun --nproc-per-node 8 pretrain_gpt_hsap.py)
fi
"${launch[@]}" \
    --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --num-query-groups 8 \
    --ffn-hidden-size 8192 --swiglu --normalization RMSNorm --disable-bias-linear \
    --seq-length 65536 --max-position-embeddings 65536 --position-embedding-type rope --rotary-base 500000 \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
    --context-parallel-size 8 --context-parallel-mode hsap --head-chunk-size 8 --attention-kernel auto \
    --micro-batch-size 1 --global-batch-size 8 --train-iters 1000 \
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 \
    --bf16 --use-distributed-optimizer --recompute-granularity full \
    ${DATA:+--data-path "$DATA" --split 99,1,0} --tokenizer-type ${TOKENIZER_TYPE:-ByteLevelTokenizer} \
    ${TOKENIZER_MODEL:+--tokenizer-model "$TOKENIZER_MODEL"} \
    --reset-attention-mask --eod-mask-loss \
    --save checkpoints/gpt_hsap --load checkpoints/gpt_hsap --save-interval 200 \
    --log-interval 10 --tensorboard-dir runs/gpt_hsap "$@"
