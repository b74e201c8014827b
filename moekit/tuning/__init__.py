"""Config choice per op family: config types, shape-based defaults, autotune candidates."""
