"""Calls between the process that runs a check and the process that runs a student's code.

Values cross a socket as plain data: None, bool, int, float, complex, str, bytes, lists,
tuples, dicts and sets of them, torch tensors (with their whole storage, so that views
stay views), numpy arrays and scalars, dtypes, and the instances of dataclasses, named
tuples and enums whose class belongs to an installed module. The receiving side rebuilds
them as exact built-in types with the values the bytes say: an object whose `__eq__` or
`__torch_function__` the student wrote never reaches the check. Anything else (a
function, a student's class or its instances, an engine) crosses as a reference: the
other side holds a `Remote`, and what it does with it (call it, read an attribute, index
it, iterate it) is a request answered by the side that owns the object. A `Remote` the
check holds answers no comparison: `==` is identity, so a student's object cannot decide
that it equals the expected value. Functions, classes and modules of installed packages
cross by name and are looked up on the receiving side, which uses its own copy.

Arguments passed by value that are mutable (lists, dicts, sets, tensors, arrays) are
sent back after the call and written into the caller's objects, so that a function that
fills its output tensor (a kernel) or mutates its input (a wrong answer a check looks
for) does so visibly.

This module imports only the standard library; torch and numpy are used when the
process has imported them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import socket
import struct
import sys
import traceback
import types

MAX_DEPTH = 40
# exceptions of these modules are rebuilt as themselves on the check's side; any other
# (a student's class, or a library's control flow such as hypothesis's) as its nearest
# built-in base class
EXCEPTION_MODULES = ("builtins", "minillm", "kernels", "torch", "numpy", "triton")
_FAILED = object()


class ByReference:
    """A value to send as a reference even when it could cross by value or by name: a
    module or an installed function the check lends the student's code, so that its calls
    run in the check's process (see `sandbox.lend`)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


class PeerGone(Exception):
    """The other process ended (or broke the protocol) while a request was open."""


def _resolve(module: str, qualname: str) -> object:
    """An object of an imported module by name, or _FAILED; imports nothing."""
    if module == "__main__" or module not in sys.modules or "<" in qualname:
        return _FAILED
    value: object = sys.modules[module]
    for part in qualname.split("."):
        try:
            value = getattr(value, part)
        except Exception:
            return _FAILED
    return value


def _name_of(value: object) -> tuple[str, str] | None:
    """(module, qualname) under which the receiving side finds this very object, if any."""
    if isinstance(value, types.ModuleType):
        return (value.__name__, "") if value.__name__ != "__main__" else None
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if module == "__main__" or "<" in qualname:
        return None
    try:
        return (module, qualname) if _resolve(module, qualname) is value else None
    except Exception:
        return None


def _exact(value: object, kind: type) -> object:
    """The built-in value of a (possibly subclassed) int, float, str or bytes."""
    if kind is int:
        return int(int.__repr__(value))
    if kind is float:
        return float(float.__repr__(value))
    if kind is str:
        return "".join(str.__iter__(value))
    return bytes(bytearray(value))


class Connection:
    """One end of the socket between the check's process and the student's.

    `trusted` is the check's end: the `Remote`s it creates answer no comparison, and it
    sends the instances of installed classes that it owns as references (so that the
    student's code works on the check's objects); the student's end sends those by value.
    """

    def __init__(self, sock: socket.socket, trusted: bool) -> None:
        self.sock = sock
        self.trusted = trusted
        self.exported: dict[int, object] = {}
        self.remotes: dict[int, Remote] = {}
        self.remote_class = Remote if trusted else OpenRemote
        self.sources: dict[str, str] = {}  # the student's cells, to quote the line that raised
        self.gone = False
        # objects that came by value, by id: sent back, they are the sender's own object again
        self.echoes: dict[int, tuple[object, int]] = {}

    # framing: a JSON header, then binary blobs (the bytes of tensors and arrays)

    def _send(self, header: dict, blobs: list[bytes]) -> None:
        data = json.dumps(header).encode()
        parts = [struct.pack("!II", len(data), len(blobs)), data]
        for blob in blobs:
            parts.append(struct.pack("!Q", len(blob)))
            parts.append(blob)
        self.sock.sendall(b"".join(parts))

    def _recv_exactly(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 22))
            if not chunk:
                self.gone = True
                raise PeerGone("the other process ended")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _recv(self) -> tuple[dict, list[bytes]]:
        size, count = struct.unpack("!II", self._recv_exactly(8))
        header = json.loads(self._recv_exactly(size))
        blobs = []
        for _ in range(count):
            (n,) = struct.unpack("!Q", self._recv_exactly(8))
            blobs.append(self._recv_exactly(n))
        if not isinstance(header, dict):
            raise PeerGone("a malformed message")
        return header, blobs

    # values

    def encode(self, value: object, blobs: list[bytes], storages: dict, depth: int = 0):
        kind = type(value)
        if value is None or kind is bool:
            return value
        if kind in (int, float, str):
            return {"v": value} if kind is float and value != value else value  # NaN
        if isinstance(value, Remote) and object.__getattribute__(value, "_conn") is self:
            return {"h": object.__getattribute__(value, "_id")}
        if kind is ByReference and self.trusted:
            return self._reference(value.value)
        echo = self.echoes.get(id(value))
        if echo is not None and echo[0] is value:
            return {"h": echo[1]}
        if depth > MAX_DEPTH:
            return self._reference(value)
        deeper = depth + 1
        if isinstance(value, bool):
            return bool(value)
        for base in (int, float, str):
            if isinstance(value, base):
                return self.encode(_exact(value, base), blobs, storages, deeper)
        if isinstance(value, bytes | bytearray):
            blobs.append(_exact(value, bytes))
            return {"b": len(blobs) - 1, "mut": isinstance(value, bytearray)}
        if isinstance(value, complex):
            return {"c": [complex.__getattribute__(value, "real"), value.imag]}
        if value is Ellipsis:
            return {"e": 0}
        torch = sys.modules.get("torch")
        if torch is not None:
            if isinstance(value, torch.Tensor):
                return self._tensor(value, blobs, storages)
            if isinstance(value, torch.dtype):
                return {"dt": str(value).removeprefix("torch.")}
            if isinstance(value, torch.device):
                return {"dev": str(value)}
            if isinstance(value, torch.Size):
                return {"sz": [int(d) for d in value]}
            if isinstance(value, torch.Generator):  # its state crosses, and comes back
                state = value.get_state()
                blobs.append(state.numpy().tobytes())
                return {"gen": len(blobs) - 1}
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            if isinstance(value, numpy.ndarray) and not value.dtype.hasobject:
                array = numpy.ascontiguousarray(value)
                blobs.append(array.tobytes())
                return {"A": [array.dtype.str, list(array.shape), len(blobs) - 1]}
            if isinstance(value, numpy.generic) and not isinstance(value, numpy.object_):
                blobs.append(numpy.asarray(value).tobytes())
                return {"ns": [value.dtype.str, len(blobs) - 1]}
            if isinstance(value, numpy.dtype) and not value.hasobject:
                return {"nd": value.str}
        if isinstance(value, list):
            return {"l": [self.encode(v, blobs, storages, deeper) for v in list(value)]}
        if isinstance(value, dict):
            items = list(dict.items(value))
            return {
                "d": [
                    [
                        self.encode(k, blobs, storages, deeper),
                        self.encode(v, blobs, storages, deeper),
                    ]
                    for k, v in items
                ]
            }
        if isinstance(value, set | frozenset):
            tag = "s" if isinstance(value, set) else "f"
            return {tag: [self.encode(v, blobs, storages, deeper) for v in list(value)]}
        if isinstance(value, range):
            return {"rg": [value.start, value.stop, value.step]}
        if isinstance(value, slice):
            return {
                "sl": [
                    self.encode(v, blobs, storages, deeper)
                    for v in (value.start, value.stop, value.step)
                ]
            }
        name = _name_of(value)
        if name is not None and (isinstance(value, type | types.ModuleType) or callable(value)):
            return {"n": list(name), "r": self._reference(value)["r"]}
        cls = type(value)
        cls_name = _name_of(cls)
        if isinstance(value, tuple):
            items = [self.encode(v, blobs, storages, deeper) for v in tuple.__iter__(value)]
            if cls_name is not None and hasattr(cls, "_fields"):
                return {"nt": list(cls_name), "t": items}
            return {"t": items}
        if cls_name is not None:
            if isinstance(value, enum.Enum):
                return {"en": list(cls_name), "name": value.name}
            if dataclasses.is_dataclass(value) and not (
                self.trusted and not cls.__dataclass_params__.frozen
            ):
                fields = {
                    f.name: self.encode(getattr(value, f.name), blobs, storages, deeper)
                    for f in dataclasses.fields(value)
                }
                self.exported[id(value)] = value
                return {"dc": list(cls_name), "fields": fields, "id": id(value)}
        return self._reference(value)

    def _reference(self, value: object) -> dict:
        self.exported[id(value)] = value
        classes = []
        for cls in type.__getattribute__(type(value), "__mro__"):
            name = _name_of(cls)
            if name is not None and name[0] != "builtins":
                classes.append(list(name))
                break
        return {"r": [id(value), classes, isinstance(value, type)]}

    def _tensor(self, tensor, blobs: list[bytes], storages: dict) -> dict:
        torch = sys.modules["torch"]
        with torch._C.DisableTorchFunction():
            t = torch.Tensor.detach(tensor)
            if t.layout != torch.strided or t.is_quantized:
                t = t.to_dense() if t.layout != torch.strided else t.dequantize()
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in storages:
                raw = torch.empty(0, dtype=torch.uint8)
                raw.set_(storage, 0, (storage.nbytes(),), (1,))
                blobs.append(raw.cpu().numpy().tobytes())
                storages[key] = len(blobs) - 1
            return {
                "T": [
                    str(t.dtype).removeprefix("torch."),
                    list(t.shape),
                    list(t.stride()),
                    int(t.storage_offset()),
                    storages[key],
                    bool(tensor.requires_grad),
                ]
            }

    def decode(self, node, blobs: list[bytes], storages: dict):
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is not dict or len(node) == 0:
            raise PeerGone("a malformed value")
        if "l" in node:
            return [self.decode(v, blobs, storages) for v in node["l"]]
        if "t" in node:
            items = tuple(self.decode(v, blobs, storages) for v in node["t"])
            if "nt" in node:
                cls = _resolve(*node["nt"])
                if isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_make"):
                    return cls._make(items)
            return items
        if "d" in node:
            return {
                self.decode(k, blobs, storages): self.decode(v, blobs, storages)
                for k, v in node["d"]
            }
        if "s" in node:
            return {self.decode(v, blobs, storages) for v in node["s"]}
        if "f" in node:
            return frozenset(self.decode(v, blobs, storages) for v in node["f"])
        if "v" in node:
            return float("nan")
        if "b" in node:
            data = blobs[node["b"]]
            return bytearray(data) if node.get("mut") else bytes(data)
        if "c" in node:
            return complex(float(node["c"][0]), float(node["c"][1]))
        if "e" in node:
            return Ellipsis
        if "rg" in node:
            return range(*(int(v) for v in node["rg"]))
        if "sl" in node:
            return slice(*(self.decode(v, blobs, storages) for v in node["sl"]))
        if "T" in node:
            return self._decode_tensor(node["T"], blobs, storages)
        if "dt" in node:
            torch = sys.modules["torch"]
            dtype = getattr(torch, str(node["dt"]), None)
            if not isinstance(dtype, torch.dtype):
                raise PeerGone("an unknown dtype")
            return dtype
        if "dev" in node:
            return sys.modules["torch"].device(str(node["dev"]))
        if "gen" in node:
            torch = sys.modules["torch"]
            generator = torch.Generator()
            state = torch.frombuffer(bytearray(blobs[node["gen"]]), dtype=torch.uint8)
            generator.set_state(state)
            return generator
        if "sz" in node:
            return sys.modules["torch"].Size([int(d) for d in node["sz"]])
        if "A" in node or "ns" in node or "nd" in node:
            numpy = sys.modules["numpy"]
            spec = node.get("A") or node.get("ns") or [node["nd"]]
            dtype = numpy.dtype(str(spec[0]))
            if dtype.hasobject:
                raise PeerGone("an array of objects")
            if "nd" in node:
                return dtype
            if "ns" in node:
                return numpy.frombuffer(blobs[spec[1]], dtype=dtype)[0]
            return numpy.frombuffer(bytearray(blobs[spec[2]]), dtype=dtype).reshape(
                [int(d) for d in spec[1]]
            )
        if "n" in node:
            value = _resolve(*node["n"]) if node["n"][1] else sys.modules.get(node["n"][0], _FAILED)
            if value is not _FAILED and value is not None:
                return value
            return self._remote(node["r"])
        if "en" in node:
            cls = _resolve(*node["en"])
            if isinstance(cls, type) and issubclass(cls, enum.Enum):
                return cls[str(node["name"])]
            raise PeerGone("an unknown enum")
        if "dc" in node:
            cls = _resolve(*node["dc"])
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                raise PeerGone("an unknown dataclass")
            obj = cls.__new__(cls)
            names = {f.name for f in dataclasses.fields(cls)}
            for key, value in node["fields"].items():
                if key in names:
                    object.__setattr__(obj, key, self.decode(value, blobs, storages))
            if not self.trusted and type(node.get("id")) is int:
                self.echoes[id(obj)] = (obj, node["id"])
            return obj
        if "h" in node:
            try:
                return self.exported[int(node["h"])]
            except KeyError:
                raise PeerGone("a reference to nothing") from None
        if "r" in node:
            return self._remote(node["r"])
        raise PeerGone("a malformed value")

    def _decode_tensor(self, spec, blobs, storages):
        torch = sys.modules["torch"]
        dtype_name, shape, stride, offset, blob, grad = spec
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise PeerGone("an unknown dtype")
        storage = storages.get(blob)
        if storage is None:
            data = blobs[blob]
            raw = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if data
                else torch.empty(0, dtype=torch.uint8)
            )
            storage = storages[blob] = raw.untyped_storage()
        t = torch.empty(0, dtype=dtype)
        t.set_(storage, int(offset), [int(d) for d in shape], [int(s) for s in stride])
        if grad and t.is_floating_point():
            t.requires_grad_(True)
        return t

    def _remote(self, spec) -> Remote:
        ident, classes, is_class = int(spec[0]), spec[1], bool(spec[2])
        if ident in self.remotes:
            return self.remotes[ident]
        claimed = None
        for name in classes:
            cls = _resolve(*name)
            if isinstance(cls, type) and cls.__module__ != "builtins":
                claimed = cls
                break
        remote = self.remote_class.__new__(self.remote_class)
        for attr, value in (
            ("_conn", self),
            ("_id", ident),
            ("_claimed", claimed),
            ("_is_class", is_class),
        ):
            object.__setattr__(remote, attr, value)
        self.remotes[ident] = remote
        return remote

    # requests

    def request(self, op: str, target: int, *args, **kwargs):
        """Ask the other side to do `op` on its object `target`; serve its requests meanwhile."""
        blobs: list[bytes] = []
        storages: dict = {}
        encoded_args = [self.encode(a, blobs, storages) for a in args]
        encoded_kwargs = {str(k): self.encode(v, blobs, storages) for k, v in kwargs.items()}
        header = {"op": op, "target": target, "args": encoded_args, "kwargs": encoded_kwargs}
        torch = sys.modules.get("torch")
        if op == "call" and not self.trusted and torch is not None:
            # the caller's autograd mode: a model the check owns runs as the student's
            # `with torch.inference_mode():` asked
            header["modes"] = [
                bool(torch.is_grad_enabled()),
                bool(torch.is_inference_mode_enabled()),
            ]
        self._send(header, blobs)
        while True:
            header, blobs = self._recv()
            if "op" in header:
                self._serve(header, blobs)
                continue
            storages = {}
            if "after" in header:
                self._write_back(args, kwargs, header["after"], blobs, storages)
            if "error" in header:
                raise self._exception(header["error"], blobs, storages)
            return self.decode(header["value"], blobs, storages)

    def serve_forever(self) -> None:
        """Answer requests until the other side closes the socket."""
        while True:
            try:
                header, blobs = self._recv()
            except PeerGone:
                return
            if "op" in header:
                self._serve(header, blobs)

    def _serve(self, header: dict, blobs: list[bytes]) -> None:
        storages: dict = {}
        out: list[bytes] = []
        out_storages: dict = {}
        reply: dict = {}
        try:
            target = self.exported[int(header["target"])] if header["target"] is not None else None
            args = [self.decode(a, blobs, storages) for a in header["args"]]
            kwargs = {k: self.decode(v, blobs, storages) for k, v in header["kwargs"].items()}
            if self.trusted and header["op"] in ("getattr", "setattr", "delattr"):
                _public(args[0] if args else None)
            with _modes(header.get("modes") if self.trusted else None):
                value = _OPS[header["op"]](target, *args, **kwargs)
            if header["op"] == "call":
                reply["after"] = self._after(args, kwargs, header, blobs, out, out_storages)
            if self.trusted and header["op"] == "getattr" and _holds_objects(value):
                # a structure of the check's objects (a tree's children): the student's code
                # changes the check's, not a copy
                reply["value"] = self._reference(value)
            else:
                reply["value"] = self.encode(value, out, out_storages)
        except BaseException as exc:  # whatever the code raised goes back to the caller
            if isinstance(exc, PeerGone):
                raise
            out, out_storages = [], {}
            reply = {"error": self._encode_exception(exc, out, out_storages)}
        for stream in (sys.stdout, sys.stderr):  # the caller may end this process any time now
            try:
                stream.flush()
            except Exception:
                pass
        self._send(reply, out)

    # arguments written back

    @staticmethod
    def _mutable(value: object) -> bool:
        torch = sys.modules.get("torch")
        numpy = sys.modules.get("numpy")
        return (
            type(value) in (list, dict, set, bytearray)
            or (torch is not None and type(value) is torch.Tensor)
            or (numpy is not None and type(value) is numpy.ndarray)
            or (torch is not None and type(value) is torch.Generator)
        )

    def _after(self, args, kwargs, header, received, blobs, storages) -> dict:
        """The mutable arguments as the call left them, those it changed only."""
        after: dict = {"args": {}, "kwargs": {}}
        pairs = [("args", str(i), a, header["args"][i]) for i, a in enumerate(args)]
        pairs += [("kwargs", k, v, header["kwargs"][k]) for k, v in kwargs.items()]
        for where, key, value, sent in pairs:
            if not self._mutable(value):
                continue
            own: list[bytes] = []
            node = self.encode(value, own, {})
            if _canonical(node, own) == _canonical(sent, received):
                continue
            after[where][key] = _shift(node, len(blobs))
            blobs.extend(own)
        return after

    def _write_back(self, args, kwargs, after, blobs, storages) -> None:
        pairs = [(args[int(i)], v) for i, v in after.get("args", {}).items() if int(i) < len(args)]
        pairs += [(kwargs[k], v) for k, v in after.get("kwargs", {}).items() if k in kwargs]
        for original, node in pairs:
            if not self._mutable(original):
                continue
            new = self.decode(node, blobs, storages)
            if type(new) is not type(original):
                continue
            if isinstance(original, list | bytearray):
                original[:] = new
            elif isinstance(original, dict | set):
                original.clear()
                original.update(new)
            elif type(original).__name__ == "Generator" and hasattr(original, "set_state"):
                original.set_state(new.get_state())
            elif type(original).__module__ == "numpy":
                if original.shape == new.shape and original.flags.writeable:
                    original[...] = new
            else:
                _copy_storage(original, new)

    # exceptions

    def _encode_exception(self, exc: BaseException, blobs, storages) -> dict:
        classes = []
        for cls in type(exc).__mro__:
            name = _name_of(cls)
            if name is not None:
                classes.append(list(name))
        try:
            args = self.encode(list(exc.args), blobs, storages)
        except Exception:
            args = {"l": []}
        where = getattr(exc, "_minillm_where", None)
        if where is None:
            for frame, lineno in traceback.walk_tb(exc.__traceback__):
                filename = frame.f_code.co_filename
                if filename in self.sources:
                    lines = self.sources[filename].split("\n")
                    text = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
                    where = f"{filename[1:-1]}, line {lineno}: {text}"
        try:
            message = str(exc)
        except Exception:
            message = ""
        return {
            "classes": classes,
            "args": args,
            "message": message,
            "where": where,
            "type": type(exc).__name__,
        }

    def _exception(self, spec: dict, blobs, storages) -> BaseException:
        exc: BaseException | None = None
        for name in spec.get("classes", []):
            module, qualname = name
            if not self.trusted or module.split(".")[0] in EXCEPTION_MODULES:
                cls = _resolve(module, qualname)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    if self.trusted and not issubclass(cls, Exception):
                        continue  # SystemExit, KeyboardInterrupt: the check fails, it does not end
                    try:
                        exc = cls(*self.decode(spec["args"], blobs, storages))
                    except Exception:
                        try:
                            exc = cls(str(spec.get("message", "")))
                        except Exception:
                            continue
                    break
        if exc is None:
            exc = RuntimeError(f"{spec.get('type', 'an exception')}: {spec.get('message', '')}")
        where = spec.get("where")
        if where is not None:
            try:
                exc._minillm_where = str(where)
            except Exception:
                pass
        return exc


_BLOB_TAGS = {"T": 4, "A": 2, "ns": 1, "b": None, "gen": None}


def _walk_blobs(node, change):
    """A copy of an encoded value whose blob indices went through change(index)."""
    if isinstance(node, list):
        return [_walk_blobs(n, change) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _BLOB_TAGS and _BLOB_TAGS[key] is None and type(value) is int:
            out[key] = change(value)
        elif key in _BLOB_TAGS and isinstance(value, list):
            position = _BLOB_TAGS[key]
            value = list(value)
            value[position] = change(value[position])
            out[key] = value
        else:
            out[key] = _walk_blobs(value, change)
    return out


def _canonical(node, blobs) -> tuple:
    """An encoded value with the bytes it refers to, independent of where those sit."""
    used: list[bytes] = []

    def take(index):
        used.append(blobs[index])
        return len(used) - 1

    return json.dumps(_walk_blobs(node, take), sort_keys=True), used


def _shift(node, offset: int):
    return _walk_blobs(node, lambda index: index + offset)


_DATA = (type(None), bool, int, float, complex, str, bytes, tuple, frozenset)


def _holds_objects(value: object) -> bool:
    """A list, dict or set that holds objects which cross by reference."""
    if type(value) not in (list, dict, set):
        return False
    items = list(value.values()) if type(value) is dict else list(value)
    for item in items[:64]:
        if isinstance(item, (*_DATA, list, dict, set)):
            continue
        module = type(item).__module__.split(".")[0]
        if module in ("torch", "numpy") or isinstance(item, enum.Enum):
            continue
        return True
    return False


def _copy_storage(original, new) -> None:
    """Write a tensor's storage, as the other side left it, into the caller's tensor."""
    torch = sys.modules["torch"]
    target = original.untyped_storage()
    source = new.untyped_storage()
    if target.nbytes() != source.nbytes():
        return
    with torch.no_grad():
        target.copy_(source)


def _public(name: object) -> None:
    """The check's objects answer the student's code about their public attributes only:
    through `__globals__`, `__self__` or `__class__` a function or method the check lends
    would lead to the check's own namespace (its expected values, its `torch`), and
    through a private attribute to the records a lent instrument keeps."""
    if not isinstance(name, str) or name.startswith("_"):
        raise AttributeError(f"{name!r}: the check's objects show their public attributes only")


def _call(target, *args, **kwargs):
    return target(*args, **kwargs)


def _getattr(target, name):
    if not isinstance(name, str):
        raise TypeError("attribute name must be a string")
    return getattr(target, name)


def _setattr(target, name, value):
    setattr(target, name, value)


def _next(target):
    return next(target)


def _isinstance(target, value):
    return isinstance(value, target)


_OPS = {
    "call": _call,
    "getattr": _getattr,
    "setattr": _setattr,
    "delattr": lambda t, name: delattr(t, name),
    "getitem": lambda t, key: t[key],
    "setitem": lambda t, key, value: t.__setitem__(key, value),
    "delitem": lambda t, key: t.__delitem__(key),
    "len": lambda t: len(t),
    "iter": lambda t: iter(t),
    "next": _next,
    "contains": lambda t, v: v in t,
    "bool": lambda t: bool(t),
    "repr": lambda t: repr(t),
    "str": lambda t: str(t),
    "isinstance": _isinstance,
    "enter": lambda t: t.__enter__(),
    "exit": lambda t, *a: t.__exit__(*a),
    "eq": lambda t, v: t == v,
    "lt": lambda t, v: t < v,
    "le": lambda t, v: t <= v,
    "hash": lambda t: hash(t),
    "names": lambda t: None,
}


def _modes(modes):
    """The autograd mode a call asked for (grad enabled, inference mode), if it said."""
    torch = sys.modules.get("torch")
    if torch is None or type(modes) is not list or len(modes) != 2:
        return contextlib.nullcontext()
    grad, inference = (m is True for m in modes)
    if inference:
        return torch.inference_mode(True)
    return torch.set_grad_enabled(grad)


def _req(self: Remote, op: str, *args, **kwargs):
    conn = object.__getattribute__(self, "_conn")
    return conn.request(op, object.__getattribute__(self, "_id"), *args, **kwargs)


class Remote:
    """An object of the other process. Comparisons are identity: the owner is not asked."""

    __slots__ = ("_conn", "_id", "_claimed", "_is_class", "__weakref__")

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocols (__array_interface__, ...) stay local
        return _req(self, "getattr", name)

    def __setattr__(self, name: str, value) -> None:
        _req(self, "setattr", name, value)

    def __delattr__(self, name: str) -> None:
        _req(self, "delattr", name)

    def __call__(self, *args, **kwargs):
        return _req(self, "call", *args, **kwargs)

    def __getitem__(self, key):
        return _req(self, "getitem", key)

    def __setitem__(self, key, value) -> None:
        _req(self, "setitem", key, value)

    def __delitem__(self, key) -> None:
        _req(self, "delitem", key)

    def __len__(self) -> int:
        return _req(self, "len")

    def __iter__(self):
        return _req(self, "iter")

    def __next__(self):
        return _req(self, "next")

    def __contains__(self, value) -> bool:
        return _req(self, "contains", value) is True

    def __bool__(self) -> bool:
        return _req(self, "bool") is True

    def __repr__(self) -> str:
        text = _req(self, "repr")
        return text if type(text) is str else "<remote object>"

    def __str__(self) -> str:
        text = _req(self, "str")
        return text if type(text) is str else "<remote object>"

    def __enter__(self):
        return _req(self, "enter")

    def __exit__(self, *exc_info):
        return _req(self, "exit", None, None, None)

    def __instancecheck__(self, value) -> bool:
        return _req(self, "isinstance", value) is True

    def __eq__(self, other) -> bool:
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    def __hash__(self) -> int:
        return id(self)

    @property
    def __class__(self):
        claimed = object.__getattribute__(self, "_claimed")
        return claimed if claimed is not None else type(self)


class OpenRemote(Remote):
    """An object of the check's process, as the student's code sees it: it compares too."""

    __slots__ = ()

    def __eq__(self, other):
        return _req(self, "eq", other)

    def __ne__(self, other):
        return not _req(self, "eq", other)

    def __lt__(self, other):
        return _req(self, "lt", other)

    def __le__(self, other):
        return _req(self, "le", other)

    def __hash__(self):
        return _req(self, "hash")


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
