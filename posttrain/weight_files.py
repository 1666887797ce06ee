"""A Hugging Face model directory's safetensors files, checked from their headers before anything
loads them.

transformers reads `model.safetensors`, or the shards `model.safetensors.index.json` names; a shard
that is missing, truncated or overwritten surfaces from it as a bare `FileNotFoundError` or
safetensors' `header too small` that names no file, minutes into a stage. `weight_headers` reads
what transformers would read (headers only: cheap even for a released checkpoint's 1.5 TB) and
raises `ValueError` naming the file, the tensor and the fix. Torch-free, so `posttrain plan` runs it
on a stage's `model:` directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weights transformers also reads, in formats without a header to check here.
OTHER_WEIGHT_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
RECOPY = "copy or export the checkpoint again"


@dataclass(frozen=True)
class TensorHeader:
    dtype: str  # safetensors' dtype code: F32, BF16, U8, I64, BOOL, ...
    shape: tuple[int, ...]

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("F", "BF"))  # F64, F32, F16, BF16, F8_E4M3, ...


def weight_headers(model_dir: str | Path) -> dict[str, dict[str, TensorHeader]]:
    """{file name: {tensor name: header}} of the safetensors files transformers loads from
    `model_dir`: the files the index names, or `model.safetensors`. A directory with only
    `pytorch_model.bin` weights gives {} (transformers checks those itself).

    Raises:
        ValueError: no weights at all, an index that is not JSON or has no `weight_map`, a file the
            index names that is absent or unreadable, a tensor the index places in a file that does
            not hold it; the message names the file (and tensor) and the fix.
    """
    from safetensors import SafetensorError, safe_open

    directory = Path(model_dir)
    index_file = directory / INDEX_FILE
    if index_file.is_file():
        weight_map = _weight_map(index_file)
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    elif any((directory / name).is_file() for name in OTHER_WEIGHT_FILES):
        return {}
    else:
        raise ValueError(
            f"{directory} holds no weights ({SINGLE_FILE}, or shards listed in {INDEX_FILE}): "
            f"{RECOPY}, or point at the directory that holds them"
        )
    headers: dict[str, dict[str, TensorHeader]] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{index_file} names {name}, which is not in {directory}: {RECOPY}")
        try:
            with safe_open(str(path), framework="numpy") as f:
                slices = {key: f.get_slice(key) for key in f.keys()}
                headers[name] = {
                    key: TensorHeader(s.get_dtype(), tuple(s.get_shape())) for key, s in slices.items()
                }
        except SafetensorError as error:
            raise ValueError(
                f"{path} is not a readable safetensors file ({error}; truncated or overwritten?): {RECOPY}"
            ) from error
    for tensor, name in sorted(weight_map.items()):
        if tensor not in headers[name]:
            raise ValueError(f"{index_file} places {tensor} in {name}, which does not hold it: {RECOPY}")
    return headers


def _weight_map(index_file: Path) -> dict[str, str]:
    try:
        index = json.loads(index_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{index_file} is not valid JSON ({error}): {RECOPY}") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_file} has no `weight_map` of tensor name -> file name: {RECOPY}")
    return weight_map
