"""Read a PyTorch ``pytorch_model.bin`` without PyTorch and without running pickled code.

Such a file is a zip: ``<name>/data.pkl``, a pickle of the state dict, and
``<name>/data/<key>``, the raw bytes of each storage. Unpickling may call any importable
function, which is how a malicious checkpoint runs code. This unpickler resolves only the
names PyTorch's tensor rebuilding uses, to local functions that build numpy arrays, and
refuses every other name before anything is called.
"""

from __future__ import annotations

import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Dict

import numpy as np

from ..errors import UserError

# Storage classes PyTorch names in its pickles -> numpy dtypes; bfloat16 is widened to float32.
_STORAGES = {
    "FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
    "BFloat16Storage": np.uint16, "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
    "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _Storage:
    """A storage class named by the pickle; only its name matters."""

    def __init__(self, name: str):
        self.name = name


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or min(stride, default=0) < 0 or not 0 <= offset <= storage.size:
        raise ValueError("a tensor's shape does not fit its storage")
    if 0 in size:
        return np.zeros(size, dtype=storage.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage.size:
        raise ValueError("a tensor reaches past the end of its storage")
    if int(np.prod(size, dtype=np.float64)) > storage.size:  # a view repeating its storage (stride 0)
        raise ValueError(f"a tensor of shape {size} repeats a storage of {storage.size} values; "
                         "a saved state dict does not")
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                           strides=[s * storage.itemsize for s in stride], writeable=False)
    return np.array(view)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


_ALLOWED = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    **{("torch", name): _Storage(name) for name in _STORAGES},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, handle, archive: zipfile.ZipFile, prefix: str, source: Path):
        super().__init__(handle)
        self.archive, self.prefix, self.source = archive, prefix, source
        self.storages: Dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED.get((module, name))
        if allowed is None:
            raise UserError(
                f"{self.source}: refused: its pickle asks for {module}.{name}, which is not tensor data "
                "(a .bin checkpoint can run code when loaded); get the head as safetensors instead"
            )
        return allowed

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise UserError(f"{self.source}: unexpected storage reference {pid!r:.80}")
        _, storage_type, key, _, _ = pid
        if key not in self.storages:
            name = f"{self.prefix}/data/{key}"
            if self.archive.getinfo(name).file_size > self.source.stat().st_size:  # a compressed bomb
                raise UserError(f"{self.source}: storage {key} unpacks to more than the whole file; refused")
            raw = self.archive.read(name)
            values = np.frombuffer(raw, dtype=_STORAGES[storage_type.name])
            if storage_type.name == "BFloat16Storage":  # bfloat16 is float32's upper half
                values = (values.astype(np.uint32) << 16).view(np.float32)
            self.storages[key] = values
        return self.storages[key]


def load_torch_bin(path: Path) -> Dict[str, np.ndarray]:
    """The state dict in ``path`` as numpy arrays (bfloat16 widened to float32)."""
    try:
        archive = zipfile.ZipFile(path)
    except Exception as exc:  # BadZipFile, OSError, a name that is not UTF-8...: not a zip we can read
        raise UserError(f"{path} is not a PyTorch zip checkpoint ({exc}); pre-1.6 pickles are not read, "
                        "re-save it with a current PyTorch or get safetensors") from None
    with archive:
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise UserError(f"{path} holds no PyTorch state dict (no data.pkl)")
        prefix = pickles[0][: -len("/data.pkl")]
        try:
            if f"{prefix}/byteorder" in names and archive.read(f"{prefix}/byteorder").strip() != b"little":
                raise UserError(f"{path} was written on a big-endian machine; re-save it on a little-endian one")
            with archive.open(pickles[0]) as handle:
                state = _RestrictedUnpickler(handle, archive, prefix, path).load()
        except UserError:
            raise
        except Exception as exc:  # any way a damaged zip or pickle can fail, before anything ran
            raise UserError(f"{path} is damaged or not a state dict ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise UserError(f"{path} is not a plain state dict of tensors")
    return dict(state)
