"""Small helpers shared by every layer (no Ray, no heavy imports)."""
