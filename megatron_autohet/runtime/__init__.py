"""Training from a plan on megatron-core.

topology        pure: each rank's role and the process groups a plan needs (no torch)
"""
