"""Records that cross every boundary (Sample), chat rendering with loss masks, packing."""

from posttrain.data.sample import EFFORTS, FinishReason, Sample

__all__ = ["EFFORTS", "FinishReason", "Sample"]
