"""Synthetic slides for tests and demos: a tiled pyramidal RGB TIFF written quickly on a small CPU.

Level 0 is a grid of ``tile``-sized tiles drawn from a small palette (a fraction of them tissue-like
colour patterns, the rest white glass). With zlib (the default) each distinct tile is compressed once
and its bytes are written wherever it repeats, so a 16,384² pyramid is written in seconds. Each further level halves the previous one (2x2 mean, rounded), written as reduced pages
(``subfiletype=1``) as OpenSlide expects, with the resolution tags that give microns per pixel.
The pixels are a pure function of the arguments: ``synthetic_slide`` run twice writes the same image.
"""

from __future__ import annotations

import os

import numpy as np


def _palette(tile: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:tile, 0:tile]
    tiles = []
    for _ in range(count):
        base = rng.integers(90, 230, size=3)
        fx, fy, phase = rng.uniform(0.01, 0.08, size=2).tolist() + [rng.uniform(0, 6.3)]
        wave = (np.sin(fx * xx + phase) * np.cos(fy * yy) * 25)[..., None]
        noise = rng.integers(-12, 13, size=(tile, tile, 3))
        tiles.append(np.clip(base + wave + noise, 0, 255).astype(np.uint8))
    return tiles


def _level0_key(i: int, j: int, count: int, tissue: float, seed: int) -> int | None:
    """Which palette tile sits at (i, j) of level 0; None for white glass."""
    h = np.random.default_rng([seed, i, j])
    if h.random() >= tissue:
        return None
    return int(h.integers(count))


def _level0_tile(i: int, j: int, palette: list[np.ndarray], tissue: float, seed: int, tile: int) -> np.ndarray:
    key = _level0_key(i, j, len(palette), tissue, seed)
    return np.full((tile, tile, 3), 255, np.uint8) if key is None else palette[key]


def _encoded_tiles(get, key, r: int, c: int, level: int):
    """Level ``level``'s tiles as zlib streams, each distinct tile compressed once: a tile is a pure
    function of its key (its palette tiles beneath), and most keys repeat (white glass, the palette)."""
    import zlib

    done: dict = {}
    for i in range(r):
        for j in range(c):
            k = key(level, i, j)
            if k not in done:
                done[k] = zlib.compress(np.ascontiguousarray(get(i, j)).tobytes(), 6)
            yield done[k]


def synthetic_slide(path: str | os.PathLike, size: int | tuple[int, int], levels: int = 3, *, tile: int = 512,
                    tissue: float = 0.35, mpp: float = 0.25, seed: int = 0, palette: int = 8,
                    compression: str = "zlib", format: str = "tiff") -> str:
    """Write an RGB slide of ``size`` (an edge, or (height, width)) with ``levels`` levels; return the path.

    ``format="zarr"`` writes the same pixels as an OME-Zarr (0.5) image: arrays ``0``, ``1``, ... of
    (c, y, x) uint8 in tile-sized chunks, with each level's scale in micrometres."""
    if format not in ("tiff", "zarr"):
        raise ValueError(f"format must be 'tiff' or 'zarr', got {format!r}")

    height, width = (size, size) if isinstance(size, int) else size
    if height % (tile << (levels - 1)) or width % (tile << (levels - 1)):
        raise ValueError(f"size {height}x{width} must be a multiple of tile * 2**(levels - 1) = "
                         f"{tile << (levels - 1)}")
    tiles = _palette(tile, palette, seed)
    rows, cols = height // tile, width // tile

    def level0(i, j):
        return _level0_tile(i, j, tiles, tissue, seed, tile)

    def reduced(get, i, j):  # one tile of the next level from 2x2 tiles of this one
        block = np.concatenate([np.concatenate([get(2 * i + a, 2 * j + b) for b in (0, 1)], axis=1) for a in (0, 1)])
        b = block.astype(np.uint16)  # four strided adds: numpy's sum over the 2x2 axes is 10x slower
        total = b[0::2, 0::2] + b[1::2, 0::2] + b[0::2, 1::2] + b[1::2, 1::2]
        return ((total + 2) // 4).astype(np.uint8)

    getters = [level0]
    for _ in range(1, levels):
        getters.append(lambda i, j, g=getters[-1]: reduced(g, i, j))

    def key(level, i, j):
        if level == 0:
            return _level0_key(i, j, len(tiles), tissue, seed)
        return tuple(key(level - 1, 2 * i + a, 2 * j + b) for a in (0, 1) for b in (0, 1))

    path = os.fspath(path)
    if format == "zarr":
        return _write_ome_zarr(path, getters, rows, cols, tile, mpp)
    import tifffile

    res = 1e4 / mpp  # pixels per centimetre
    with tifffile.TiffWriter(path, bigtiff=height * width * 3 > 2**31) as tw:
        for k, get in enumerate(getters):
            r, c = rows >> k, cols >> k
            data = (_encoded_tiles(get, key, r, c, k) if compression == "zlib" else
                    (get(i, j) for i in range(r) for j in range(c)))
            tw.write(data, shape=(r * tile, c * tile, 3), dtype=np.uint8,
                     tile=(tile, tile), photometric="rgb", compression=compression,
                     subfiletype=1 if k else 0, resolution=(res / 2**k, res / 2**k), resolutionunit="CENTIMETER",
                     metadata=None)
    return path


def _write_ome_zarr(path: str, getters, rows: int, cols: int, tile: int, mpp: float) -> str:
    import zarr

    group = zarr.open_group(path, mode="w")
    datasets = []
    for k, get in enumerate(getters):
        r, c = rows >> k, cols >> k
        array = group.create_array(str(k), shape=(3, r * tile, c * tile), chunks=(3, tile, tile), dtype="uint8")
        for i in range(r):
            for j in range(c):
                array[:, i * tile:(i + 1) * tile, j * tile:(j + 1) * tile] = get(i, j).transpose(2, 0, 1)
        scale = mpp * 2**k
        datasets.append({"path": str(k), "coordinateTransformations": [{"type": "scale", "scale": [1, scale, scale]}]})
    axes = [{"name": "c", "type": "channel"}, {"name": "y", "type": "space", "unit": "micrometer"},
            {"name": "x", "type": "space", "unit": "micrometer"}]
    group.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": datasets}]}
    return path
