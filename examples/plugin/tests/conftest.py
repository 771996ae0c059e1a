"""One torch thread: the plugin's tensors are tiny, and OpenMP spin-waits slow them down."""

import torch

torch.set_num_threads(1)
