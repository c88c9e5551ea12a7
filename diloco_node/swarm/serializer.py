"""A bound on how deep hivemind's msgpack decoder nests tuples, set before any DHT starts.

hivemind sends tuples as an extension type whose body is decoded by another msgpack.unpackb call,
each holding a large stack of its own on the C stack: 400 tuples nested one in another (under
2 KB) overflow it and kill the process (SIGSEGV). The DHT decodes a store's subkey and value
before any validator looks at them, so one store by any peer ended the node (its DHT helper died,
and the watchdog ends a node whose helper is gone). `bound()` makes the decoder refuse a nest
deeper than MAX_TUPLE_DEPTH with ValueError, which hivemind answers as a failed request. dht.py
calls it in our process before the DHT's helper process is forked from it (the helper inherits the
class as patched). tests/hostile/test_parser_fuzz.py checks it in a process of its own.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack
from hivemind.utils.serializer import MSGPackSerializer

MAX_TUPLE_DEPTH = 32  # our records nest tuples 2 deep; hivemind's own values a few more

_nesting = threading.local()


def _decode_ext_types(cls: type[MSGPackSerializer], type_code: int, data: bytes) -> Any:
    if type_code != cls._TUPLE_EXT_TYPE_CODE or type_code in cls._ext_type_codes:
        return _original(type_code, data)
    depth = getattr(_nesting, "depth", 0)
    if depth >= MAX_TUPLE_DEPTH:
        raise ValueError(f"msgpack tuples nested deeper than {MAX_TUPLE_DEPTH}")
    _nesting.depth = depth + 1
    try:
        return tuple(msgpack.unpackb(data, ext_hook=cls._decode_ext_types, raw=False))
    finally:
        _nesting.depth = depth


_original = MSGPackSerializer._decode_ext_types


def bound() -> None:
    """Install the bound (idempotent)."""
    MSGPackSerializer._decode_ext_types = classmethod(_decode_ext_types)  # type: ignore[method-assign,assignment]
