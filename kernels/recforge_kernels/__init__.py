"""recforge compute kernels as torch custom ops (namespace `recforge`); importing this package registers them."""
from recforge_kernels.sigrid_hash import sigrid_hash, sigrid_hash_multi, sigrid_hash_raw

__all__ = ["sigrid_hash", "sigrid_hash_multi", "sigrid_hash_raw"]
