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
import os
import re
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("bf16", "mxfp4")
# The units huggingface_hub's shard splitter reads in a size string (decimal, as it counts them).
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]B)\s*", re.IGNORECASE)
log = logging.getLogger(__name__)


class ExportError(ValueError):
    """Bad input to `posttrain export`; the message names the path and the fix."""


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    files: list[str]
    qat_scheme: str | None  # the recorded QAT scheme, None when the stage recorded none


def shard_size_bytes(size: str | int) -> int:
    """`--max-shard-size` in bytes: a positive int, or a number with KB, MB, GB or TB ("5GB",
    "200KB"), read as huggingface_hub's shard splitter reads it. Checked before the model loads:
    the splitter's own error would come minutes later, as a traceback."""
    if isinstance(size, int):
        bytes_ = size
    else:
        match = SIZE.fullmatch(size)
        if match is None:
            raise ExportError(
                f"--max-shard-size {size!r}: write a number and a unit (KB, MB, GB, TB), e.g. 5GB"
            )
        bytes_ = int(float(match[1]) * SIZE_UNITS[match[2].upper()])
    if bytes_ < 1:
        raise ExportError(f"--max-shard-size {size!r}: must be at least one byte, e.g. 5GB")
    return bytes_


def check_out_dir(out_dir: Path) -> None:
    """Refuse an `--out` that cannot be written before the model loads: it must be new or an empty
    directory, and the directory it goes in must be one this process may write (the export is
    written as a sibling of `out_dir` and renamed, creating missing parents first)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"--out {out_dir} exists and is not an empty directory: choose a new one")
    parent = out_dir.absolute().parent
    while not parent.exists():  # also False for a path under a file
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"--out {out_dir}: {parent} is a file, not a directory: choose an --out outside it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(
            f"--out {out_dir}: cannot write in {parent} (no permission or a read-only file system): "
            "choose a directory you may write to"
        )
    for above in out_dir.resolve().parents:
        # Writing into a stage's published model/ changes the files its manifest vouches for: the
        # stage turns damaged, and the export would sit inside the model it was made from.
        if above.name == "model" and (above.parent / "manifest.json").is_file():
            raise ExportError(
                f"--out {out_dir} is inside the published model {above} of stage {above.parent.name}: "
                "choose an --out outside the run's stage dirs"
            )


def model_dir_of(source: Path) -> Path:
    """The model directory of `source`: a stage dir (RUN_DIR/STAGE, holding `model/`) or a model dir."""
    if not source.exists():
        raise ExportError(f"{source} does not exist: pass RUN_DIR/STAGE (e.g. runs/mopd/mopd) or a model dir")
    for candidate in (source / "model", source):
        if (candidate / "config.json").is_file():
            return candidate
    if (source / "model").is_dir():
        raise ExportError(
            f"{source / 'model'} has no config.json: not a Hugging Face model dir (the stage's kind saved "
            "another format, or the file was removed); export takes a transformers model"
        )
    if (source / "manifest.json").is_file():
        raise ExportError(
            f"{source} is a stage dir without model/: the stage has not finished (see its log), or its "
            f"model/ was removed (rerun it with --restart {source.name})"
        )
    raise ExportError(
        f"{source} holds neither model/config.json nor config.json: pass RUN_DIR/STAGE of a finished stage"
    )


def export_model(
    source: str | Path, fmt: str, out_dir: str | Path, max_shard_size: str | int | None = None
) -> ExportResult:
    """Write the model of `source` (see `model_dir_of`) in format `fmt` to `out_dir` (new or empty),
    sharded above `max_shard_size` (None: the released layout's default)."""
    # Imported here: the CLI checks --max-shard-size with this module while parsing, without
    # paying for torch and transformers.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.model import KimiK3ForCausalLM, save_released
    from posttrain.model.released import DEFAULT_MAX_SHARD_SIZE
    from posttrain.qat import qat_config_of, restore_qat
    from posttrain.qat.export import export_dequantized, export_mxfp4

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    max_shard_size = shard_size_bytes(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    model_dir = model_dir_of(Path(source))
    tokenizer = None  # read first: a damaged tokenizer is found before the whole model loads
    if (model_dir / "tokenizer.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as error:  # JSON errors, and the tokenizers library's plain Exceptions
            raise ExportError(
                f"{model_dir}: cannot load its tokenizer ({error}): copy tokenizer.json and "
                "tokenizer_config.json again from the model or tokenizer it was trained with"
            ) from error
    else:
        log.warning("%s has no tokenizer.json: the export has no tokenizer or chat template", model_dir)
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
