"""Per-layer costs the cost model needs: measured on the local device or estimated analytically.

``profile``   the data (OpCost, ProfileEntry, Profile) and its YAML/JSON file; no torch.
``measure``   times megatron-core's own layer, embedding and output on this machine (child
              processes; torch and megatron are imported there, not at module import).
``estimate``  the same entries from the GPU catalog's datasheet figures; no torch.
``from_run``  a profile from a training run's measured windows (``--autohet-measured-profile``):
              the entries the plan was priced on, scaled to the stages' measured times, and the
              stragglers (GPUs slower than the others of their type); no torch.
"""
