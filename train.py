"""Train a byte-level language model with Native Sparse Attention or full attention.

    python train.py                        # enwik8 preset on a GPU, tiny preset on the CPU
    python train.py --attn full            # the full-attention baseline
    python train.py --resume               # continue the run from its latest checkpoint
    torchrun --nproc_per_node 2 train.py   # DistributedDataParallel

``python train.py --help`` lists every flag; see native_sparse_attention/training.py.
"""

import sys

from native_sparse_attention.training import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
