"""Whole-slide and large-image sources: each worker reads only its own box of each image.

    src = bigconv.data.open_image("slide.svs", mpp=0.5, scale=1 / 255)
    net.train_step([src, ...], labels, loss_fn)      # a list of sources, one per batch item

See ``sources`` (what a source is), ``readers`` (formats) and ``synthetic`` (test slides).
"""

from .readers import OPENED
from .dataset import SlideDataset, tissue_box
from .sources import ImageSource, SourceBatch, open_image
from .synthetic import synthetic_slide

__all__ = ["ImageSource", "OPENED", "SlideDataset", "SourceBatch", "open_image", "synthetic_slide", "tissue_box"]
