"""Data plumbing shared by every layer: tensor batches, sequence layout, datasets."""
