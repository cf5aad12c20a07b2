#!/usr/bin/env bash
# The embedded default on CPU (= `python pretrain_gpt_hsap.py` with no flags): a small GPT
# trained on the Python standard library's sources cut into functions, methods, class bodies and
# statement runs plus every 8th whole file (packed documents, byte-level tokens)
# with --context-parallel-mode hsap on 8 forked CPU ranks emulating 2 nodes of 4
# (Ulysses 4 inside a node x ring 2 across nodes), 150 iterations; ~3 minutes on 2 cores.
# The preset is DEMO_FLAGS in megatron_hsap/training/arguments.py; extra flags override it,
# e.g. examples/cpu_demo.sh --train-iters 20 --log-json demo.jsonl
# Python: $PYTHON, else the project's venv (`make venv`), else python3 on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" pretrain_gpt_hsap.py --demo "$@"
