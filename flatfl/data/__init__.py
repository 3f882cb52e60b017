from .datasets import DATASETS, ImageDataset, load_dataset

__all__ = ["DATASETS", "ImageDataset", "load_dataset"]
