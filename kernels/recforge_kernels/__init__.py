"""recforge compute kernels as torch custom ops (namespace `recforge`); importing this package registers them:
sigrid_hash (single op) and the horizontally fused preprocessing ops `recforge::fused_*` (fused.py)."""
from recforge_kernels import fused  # registers recforge::fused_*
from recforge_kernels.sigrid_hash import sigrid_hash, sigrid_hash_multi, sigrid_hash_raw

__all__ = ["sigrid_hash", "sigrid_hash_multi", "sigrid_hash_raw", "fused"]
