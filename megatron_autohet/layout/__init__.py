"""Where the model's parameters live in a plan: pure layout knowledge, no torch at import.

The cost model, the runtime and checkpoints all need it, so it lives below them (it imports only
plan, spec and errors) and none of them has to import another upward:

topology   each rank's role and the layer-wise gradient sync groups of a plan
params     a parameter's global name and its TP-shard layout in the full (TP1) tensor
owners     which rank holds the main copy of each parameter chunk (the one a checkpoint writes)
"""
