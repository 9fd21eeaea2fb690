"""load_checkpoint: a Pith safetensors checkpoint as named tensors and its job spec."""

import json
import struct

# safetensors dtype -> (struct/memoryview format, torch dtype name, bytes per element).
_DTYPES = {
    "F64": ("d", "float64", 8),
    "F32": ("f", "float32", 4),
    "F16": ("H", "float16", 2),  # memoryview has no half format: raw 16-bit words
    "BF16": ("H", "bfloat16", 2),  # no Python format: raw 16-bit words
    "I64": ("q", "int64", 8),
    "I32": ("i", "int32", 4),
    "I16": ("h", "int16", 2),
    "I8": ("b", "int8", 1),
    "U8": ("B", "uint8", 1),
    "BOOL": ("?", "bool", 1),
}
_MAX_HEADER_BYTES = 100 << 20


class Checkpoint:
    """A checkpoint's contents: `tensors` (name -> tensor, in the file's order), `spec`
    (the job spec the weights belong to, as a dict, or None), `step` (the step of an
    optimizer-state file; None in a weights file) and `metadata` (every `__metadata__`
    string)."""

    def __init__(self, tensors, metadata, path="checkpoint"):
        self.tensors = tensors
        self.metadata = metadata
        spec = metadata.get("pith.job_spec")
        try:
            self.spec = json.loads(spec) if spec else None
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}: __metadata__ pith.job_spec is not JSON: {e}") from None
        if self.spec is not None and not isinstance(self.spec, dict):
            raise ValueError(f"{path}: __metadata__ pith.job_spec is not a JSON object")
        step = metadata.get("step")
        if step is not None and not (step.isascii() and step.isdigit()):
            raise ValueError(f"{path}: __metadata__ step {step!r} is not a step number")
        self.step = int(step) if step is not None else None

    def __repr__(self):
        return f"Checkpoint({len(self.tensors)} tensors, step {self.step})"


def _header(data, path):
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
    (size,) = struct.unpack_from("<Q", data, 0)
    if size > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError(f"{path}: header of {size} bytes does not fit the file")
    try:
        header = json.loads(bytes(data[8:8 + size]))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    return header, 8 + size


def _ints(value, count=None):
    """`value` as a list of ints, if it is a JSON array of integers (of `count` of them)."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise ValueError("not an array of integers")
    if count is not None and len(value) != count:
        raise ValueError(f"not {count} integers")
    return value


def load_checkpoint(path, framework="torch"):
    """Reads a safetensors file (`pith checkpoint --out`, Client.checkpoint) into a
    Checkpoint. framework="torch" gives torch.Tensors (PyTorch must be installed);
    framework="python" gives memoryviews of the given shape (F16 and BF16 as raw uint16
    words; a tensor without elements flat, as memoryview takes no zero in a shape), for
    programs without PyTorch. Raises ValueError naming what is wrong with a bad file."""
    if framework not in ("torch", "python"):
        raise ValueError(f'framework is "torch" or "python", not {framework!r}')
    torch = None
    if framework == "torch":
        try:
            import torch  # noqa: PLC0415 (optional dependency)
        except ImportError:
            raise ImportError("load_checkpoint needs PyTorch for torch tensors (Debian: "
                              "python3-torch); framework=\"python\" works without it") from None
    with open(path, "rb") as f:
        data = f.read()
    header, start = _header(data, path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: __metadata__ is not an object of strings")
    tensors = {}
    for name, entry in header.items():
        try:
            fmt, torch_name, width = _DTYPES[entry["dtype"]]
            shape = _ints(entry["shape"])
            begin, end = _ints(entry["data_offsets"], 2)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name}: bad or unsupported entry {entry}") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"{path}: tensor {name}: negative dimension in {shape}")
        count = 1
        for d in shape:
            count *= d
        if begin < 0 or end < begin or start + end > len(data) or end - begin != count * width:
            raise ValueError(f"{path}: tensor {name}: data_offsets {begin}..{end} do not hold "
                             f"{entry['dtype']} {shape}")
        raw = data[start + begin:start + end]
        if entry["dtype"] == "BOOL" and raw.translate(None, b"\x00\x01"):
            raise ValueError(f"{path}: tensor {name}: BOOL bytes other than 0 and 1")
        if torch is not None:
            t = torch.frombuffer(bytearray(raw), dtype=getattr(torch, torch_name)) if raw else \
                torch.empty(0, dtype=getattr(torch, torch_name))
            tensors[name] = t.reshape(shape)
        else:
            view = memoryview(raw).cast("B").cast(fmt)
            tensors[name] = view.cast("B").cast(fmt, shape) if count else view
    return Checkpoint(tensors, metadata, path)
