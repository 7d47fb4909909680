"""Full-state checkpoints: written atomically, checked before they are trusted.

A checkpoint holds everything needed to continue as if never stopped: every object run.py gave
`job.resume()` by its state_dict (model, optimizer, scheduler, GradScaler and the precision it
ran under, EMA, the partial epoch's TrainSums; under "trainer"; objects_state / load_objects),
early-stopping state with the best weights, RNG states (python, numpy, torch CPU and the
training GPU's, if any), epoch / step / batch-in-epoch, history so far, the MLflow run id and
the config hash. It is loaded with `weights_only=True` (no pickled code runs), so everything in
it is tensors, numbers, strings, lists and dicts. `best_model.pt` is different: a plain
`state_dict` (`save_weights`), so `model.load_state_dict(torch.load(path))` works as documented.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from .runs import atomic_path

FORMAT_VERSION = 2  # 2: the objects' state_dicts under "trainer", one CUDA RNG state
NUMPY_STATE = ("name", "keys", "pos", "has_gauss", "cached")  # np.random.get_state()'s tuple


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded (corrupt, another config, another model)."""


def rng_state(device: torch.device) -> dict:
    """Python, numpy and torch CPU generators, plus the training GPU's (only that one: a resume
    may see another number of GPUs)."""
    numpy = dict(zip(NUMPY_STATE, np.random.get_state(), strict=True))  # str, ints, a float
    numpy["keys"] = torch.from_numpy(numpy["keys"].astype(np.int64))  # and the generator's keys
    state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> str | None:
    """Restore what `rng_state` saved, on `device`; returns a note when the CUDA generator could
    not be restored (the checkpoint came from a CPU run; the CUDA stream then starts from the
    seed). A CPU run ignores saved CUDA states."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = {**state["numpy"], "keys": state["numpy"]["keys"].numpy().astype(np.uint32)}
    np.random.set_state(tuple(numpy[k] for k in NUMPY_STATE))
    torch.set_rng_state(state["torch"])
    if device.type != "cuda":
        return None
    if "cuda" not in state:
        return "the checkpoint holds no CUDA RNG state (written on CPU): CUDA RNG from the seed"
    torch.cuda.set_rng_state(state["cuda"], device)
    return None


def save(path: Path, state: dict) -> None:
    """torch.save to a temp file, then os.replace: the old checkpoint survives a crash mid-write."""
    save_weights(path, {"format_version": FORMAT_VERSION, **state})


def save_weights(path: Path, obj: dict) -> None:
    """`obj` (best_model.pt: a plain state_dict, what `load_state_dict(strict=True)` takes)
    atomically, and a full disk is an OSError naming `path` (the run's disk message): given
    a path, torch.save reports it as `RuntimeError: [enforce fail at inline_container.cc]`;
    given a Python file, the file's own OSError is that RuntimeError's context, or raised."""
    with atomic_path(path) as tmp:
        try:
            with open(tmp, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())  # the space is taken now, not at some later writeback
        except (OSError, RuntimeError) as exc:
            cause = exc if isinstance(exc, OSError) else exc.__context__
            if not isinstance(cause, OSError):
                raise
            raise OSError(cause.errno, cause.strerror, str(path)) from exc


def load(path: Path, *, config_hash: str, map_location: torch.device | str = "cpu") -> dict:
    """Read and validate a checkpoint; raise CheckpointError with a readable reason."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, pickle error, not a checkpoint at all
        raise CheckpointError(
            f"{path} is corrupt or unreadable ({type(exc).__name__}: {exc}); "
            "re-run with --fresh to start over"
        ) from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} is not a checkpoint of this code (format version "
            f"{state.get('format_version') if isinstance(state, dict) else '?'}, "
            f"expected {FORMAT_VERSION}); re-run with --fresh"
        )
    if state.get("config_hash") != config_hash:
        raise CheckpointError(
            f"{path} belongs to another configuration (its hash "
            f"{state.get('config_hash')}, this run's {config_hash}); "
            "refusing to load it"
        )
    return state


def load_model_state(model: torch.nn.Module, state_dict: dict, what: str) -> None:
    """load_state_dict(strict) with a clear message when the architecture does not match."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[:3]
        raise CheckpointError(f"{what} does not fit this model: {' '.join(first)}") from exc


def precision(objects: dict, amp_dtype) -> dict:
    """What the checkpoint records of the arithmetic: the autocast dtype and the scaler."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}
    scaler = any(isinstance(o, torch.amp.GradScaler) and o.is_enabled() for o in objects.values())
    return {"autocast": names.get(amp_dtype, str(amp_dtype)), "grad_scaler": scaler}


def objects_state(objects: dict, amp_dtype) -> dict:
    """What the checkpoint holds of the objects run.py gave job.resume: each by its state_dict
    (None recorded as None), and the precision they were trained in."""
    state = {k: None if o is None else o.state_dict() for k, o in objects.items()}
    return {**state, "precision": precision(objects, amp_dtype)}


def load_objects(objects: dict, saved: dict, amp_dtype, log) -> None:
    """Every object from the checkpoint's copy (objects_state): strict, refused when it differs,
    or when one is None here and not there (an EMA that is off)."""
    for name, obj in objects.items():
        if name not in saved:
            raise CheckpointError(f"the checkpoint holds no {name!r}")
        if (saved[name] is None) != (obj is None):
            raise CheckpointError(f"the checkpoint's {name!r} setting differs from this run's")
        if obj is None:
            continue
        if isinstance(obj, torch.amp.GradScaler):
            load_scaler(obj, saved[name], saved["precision"], precision(objects, amp_dtype), log)
        elif isinstance(obj, torch.nn.Module):
            load_model_state(obj, saved[name], f"the checkpoint's {name}")
        else:
            obj.load_state_dict(saved[name])


def load_scaler(scaler, saved: dict, then: dict, now: dict, log) -> None:
    """Continue under this run's precision, whatever the checkpoint's (a requeue may land on a GPU
    without bf16, or with it): the GradScaler's state is taken over when both use one, dropped
    when this run needs none, and started afresh when only this run needs one (its first steps
    then find the scale again). run.log says which."""
    if then["autocast"] != now["autocast"]:
        log.warning(
            f"precision: the checkpoint was written under {then['autocast']}, this run "
            f"continues under {now['autocast']}"
        )
    if then["grad_scaler"] and now["grad_scaler"]:
        scaler.load_state_dict(saved)
    elif then["grad_scaler"]:
        log.warning("precision: the checkpoint's GradScaler state is dropped (not needed)")
    elif now["grad_scaler"]:
        log.warning(f"precision: a new GradScaler starts at scale {scaler.get_scale():g}")
