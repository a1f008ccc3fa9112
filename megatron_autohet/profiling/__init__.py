"""Per-layer costs the cost model needs: measured on the local device or estimated analytically.

``profile``  the data (OpCost, ProfileEntry, Profile) and its YAML/JSON file; no torch.
"""
