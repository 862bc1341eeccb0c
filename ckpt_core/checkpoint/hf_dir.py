"""Hugging Face checkpoint directories: the files of a directory, its ``model.safetensors.index.json``.

Every file name taken from an index or a listing stays inside the directory (or, for a hub cache
snapshot, inside its repository's ``blobs``); nothing outside is opened.
"""

from __future__ import annotations

import json
import os

from ckpt_core.checkpoint.safetensors import MAX_HEADER_BYTES, SafetensorsHeader, _reject_duplicates
from ckpt_core.errors import CheckpointFormatError, ConfigError

__all__ = ["INDEX_NAME", "checkpoint_files", "read_index", "check_index"]
INDEX_NAME = "model.safetensors.index.json"


def _roots(directory: str) -> tuple[str, ...]:
    """Where the files of ``directory`` may resolve to: inside it, or, for a Hugging Face hub cache
    snapshot (``.../models--X/snapshots/REV``, whose files are symlinks to ``../../blobs/HASH``), inside
    that repository's ``blobs``."""
    real = os.path.realpath(directory)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return tuple(roots)


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(os.path.commonpath([path, r]) == r for r in roots)


def _member(directory: str, name: object, where: str) -> str:
    """The path of file ``name`` of ``directory``: a plain relative name that stays inside it, and whose
    symlinks (if any) resolve inside it too; else CheckpointFormatError (nothing outside is opened)."""
    if not isinstance(name, str) or not name:
        raise CheckpointFormatError(f"{where}: file name {name!r} is not a non-empty string", path=directory)
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts or "\x00" in name:
        raise CheckpointFormatError(f"{where}: file {name[:200]!r} points outside the checkpoint directory "
                                    "(absolute or '..')", path=directory)
    full = os.path.join(directory, name)
    if not _inside(os.path.realpath(full), _roots(directory)):
        raise CheckpointFormatError(f"{where}: file {name[:200]!r} is a symlink that resolves outside the "
                                    "checkpoint directory", path=directory)
    return full


def read_index(directory: str) -> dict[str, str]:
    """The ``weight_map`` of ``directory``'s index (tensor name -> file path), validated: a JSON object
    whose ``weight_map`` maps strings to files of the directory (see :func:`_member`) that exist."""
    index = os.path.join(directory, INDEX_NAME)
    try:
        with open(index, "rb") as f:
            raw = f.read(MAX_HEADER_BYTES + 1)
    except OSError as exc:
        raise CheckpointFormatError(f"cannot read the index: {exc.strerror}", path=index) from exc
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"the index is larger than {MAX_HEADER_BYTES} bytes", path=index)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates(index))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointFormatError(f"the index is not JSON: {str(exc)[:200]}", path=index) from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError("the index has no weight_map object (tensor name -> file)", path=index)
    out, seen = {}, {}
    for tensor, name in weight_map.items():
        if name not in seen:
            seen[name] = _member(directory, name, "index weight_map")
            if not os.path.isfile(seen[name]):
                raise CheckpointFormatError(f"the index names missing files: {name[:200]!r} does not exist",
                                            path=index, tensor=tensor)
        out[tensor] = seen[name]
    return out


def check_index(weight_map: dict[str, str], headers: list[SafetensorsHeader], index_path: str) -> None:
    """Every tensor of the index is in the file it names, and every tensor of the files is in the index."""
    where = {e.name: h.path for h in headers for e in h.tensors}
    for tensor, path in weight_map.items():
        got = where.get(tensor)
        if got is None:
            raise CheckpointFormatError(f"the index maps this tensor to {os.path.basename(path)!r}, which does "
                                        "not hold it", path=index_path, tensor=tensor)
        if os.path.realpath(got) != os.path.realpath(path):
            raise CheckpointFormatError(f"the index maps this tensor to {os.path.basename(path)!r} but it is in "
                                        f"{os.path.basename(got)!r}", path=index_path, tensor=tensor)
    extra = sorted(set(where) - set(weight_map))
    if extra:
        raise CheckpointFormatError(f"{len(extra)} tensor(s) of the shards are not in the index's weight_map, "
                                    f"e.g. {extra[:3]}", path=index_path)


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a Hugging Face checkpoint directory, sorted: the files its index names
    (validated by :func:`read_index`), else every ``*.safetensors`` in it (symlinks that resolve outside
    are refused). Raises CheckpointFormatError; ConfigError when ``directory`` is not a directory."""
    if not os.path.isdir(directory):
        raise ConfigError(f"checkpoint directory {directory!r} does not exist")
    if os.path.lexists(os.path.join(directory, INDEX_NAME)):
        files = sorted(set(read_index(directory).values()))
    else:
        try:
            names = os.listdir(directory)
        except OSError as exc:
            raise ConfigError(f"cannot list checkpoint directory {directory!r}: {exc.strerror}") from exc
        files = sorted(_member(directory, n, "directory listing") for n in names if n.endswith(".safetensors"))
    if not files:
        raise CheckpointFormatError("no .safetensors files", path=directory)
    return files
