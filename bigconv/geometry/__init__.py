"""Layer 1, geometry: grids, shard boxes, windows and halo plans (``boxes``), and the separable index
maps of upsampling and padding modes (``index_maps``). Pure functions on integers and index tensors,
tested without processes."""
