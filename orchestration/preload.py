"""Imported once by the local executor's fork server (orchestration/executors.py): every stage
process is forked from it with torch, TensorBoard and the plug-in packages already imported, so a
stage starts in milliseconds instead of paying those imports again.
"""

import torch.utils.tensorboard  # noqa: F401

import orchestration._quiet  # noqa: F401  (before the plug-ins import transformers)
import orchestration.runner  # noqa: F401
from posttrain.registry import load_plugins

load_plugins()
