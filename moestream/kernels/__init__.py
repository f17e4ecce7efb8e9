"""Expert kernels: `ref.py` is the pure-torch specification; faster kernels must agree with it."""
