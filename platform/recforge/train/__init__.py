"""Training: TorchRec DLRM builders, sharding, the distributed step loop, checkpoints, metrics.

Submodules import torch/torchrec lazily at use; importing this package is cheap.
"""
