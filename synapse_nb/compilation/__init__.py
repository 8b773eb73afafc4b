"""Kernel compilation ahead of a run: the warm-up, its forwards, and its second compiling process.

  warmup    warmup(model, ...): compile or load the kernels a run calls (run_needs decides which)
  forwards  the warm-up's 3-position Session and its attention step, shared with the helper
  helper    the second process of a cold warm-up, and the cache-save lock both take

Nothing is imported here: `import synapse_nb.compilation.warmup` loads what it needs.
"""
