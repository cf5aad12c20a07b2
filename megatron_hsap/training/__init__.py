"""``pretrain_gpt_hsap.py``'s building blocks: flags, data, packing, model, loop, checkpoints, logging, launch.

Kept import-light: argument parsing must not import Megatron-Core (bad flags fail in a second).
"""
