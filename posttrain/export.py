"""`posttrain export RUN_DIR/STAGE --format bf16|mxfp4 --out DIR`: a stage's model as the checkpoint a
serving engine loads, without writing Python.

Both formats are the released K3 layout (`posttrain.model.released`) with the tokenizer, chat
template and generation config of the stage:
- `mxfp4`: routed experts packed from the trained master weights with the weight scale rule QAT
  trained against (`posttrain_qat` in the stage's config.json; OCP `floor` when the stage ran
  without QAT), compressed-tensors `quantization_config` as released, everything else bf16 — what
  vLLM's MXFP4 MoE path serves on GPUs;
- `bf16`: every tensor bf16; under QAT the routed experts are their MXFP4 values (exact in bf16), so
  an engine without MXFP4 kernels computes with the weights training saw.
Files are sharded with an index above `max_shard_size`; the output directory is written whole or
not at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.model.released import DEFAULT_MAX_SHARD_SIZE

FORMATS = ("bf16", "mxfp4")
log = logging.getLogger(__name__)


class ExportError(ValueError):
    """Bad input to `posttrain export`; the message names the path and the fix."""


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    files: list[str]
    qat_scheme: str | None  # the recorded QAT scheme, None when the stage recorded none


def model_dir_of(source: Path) -> Path:
    """The model directory of `source`: a stage dir (RUN_DIR/STAGE, holding `model/`) or a model dir."""
    if not source.exists():
        raise ExportError(f"{source} does not exist: pass RUN_DIR/STAGE (e.g. runs/mopd/mopd) or a model dir")
    for candidate in (source / "model", source):
        if (candidate / "config.json").is_file():
            return candidate
    if (source / "manifest.json").is_file():
        raise ExportError(f"{source} is a stage dir without model/: the stage has not finished (see its log)")
    raise ExportError(
        f"{source} holds neither model/config.json nor config.json: pass RUN_DIR/STAGE of a finished stage"
    )


def export_model(
    source: str | Path, fmt: str, out_dir: str | Path, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE
) -> ExportResult:
    """Write the model of `source` (see `model_dir_of`) in format `fmt` to `out_dir` (new or empty)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.model import KimiK3ForCausalLM, save_released
    from posttrain.qat import qat_config_of, restore_qat
    from posttrain.qat.export import export_dequantized, export_mxfp4

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"--out {out_dir} exists and is not an empty directory: choose a new one")
    model_dir = model_dir_of(Path(source))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    except (OSError, ValueError, KeyError) as error:
        raise ExportError(f"{model_dir}: cannot load the model: {error}") from error
    if not isinstance(model, KimiK3ForCausalLM):
        raise ExportError(
            f"{model_dir} holds a {type(model).__name__}, not a K3 model: its own save_pretrained directory "
            "is already what vLLM serves"
        )
    restore_qat(model)
    tokenizer = None
    if (model_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    else:
        log.warning("%s has no tokenizer.json: the export has no tokenizer or chat template", model_dir)
    qat = qat_config_of(model.config)
    kwargs = {"tokenizer": tokenizer, "max_shard_size": max_shard_size}
    if fmt == "mxfp4":
        export_mxfp4(model, out_dir, qat, dtype=torch.bfloat16, **kwargs)
    elif qat is not None and qat.enabled:
        export_dequantized(model, out_dir, qat, dtype=torch.bfloat16, **kwargs)
    else:
        save_released(model, out_dir, dtype=torch.bfloat16, **kwargs)
    files = sorted(p.name for p in out_dir.iterdir())
    return ExportResult(out_dir=out_dir, files=files, qat_scheme=None if qat is None else qat.scheme)
