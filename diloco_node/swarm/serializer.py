"""A bound on how deep hivemind's msgpack decoder nests its extension types, set before any DHT starts.

hivemind sends tuples (extension 0x40) and dictionary values (0x50) as extension types whose bodies
are decoded by another msgpack call, each holding a large stack of its own on the C stack: 400
tuples nested one in another (under 2 KB), or 240 dictionary values, overflow it and kill the
process (SIGSEGV). The DHT decodes a store's subkey and value before any validator looks at them,
so one store by any peer ended the node (its DHT helper died, and the watchdog ends a node whose
helper is gone). `bound()` makes the decoder refuse extension types nested deeper than
MAX_EXT_DEPTH, whatever their type, with ValueError, which hivemind answers as a failed request.
dht.py calls it in our process before the DHT's helper process is forked from it (the helper, a
fork, inherits the class as patched). tests/hostile/test_parser_fuzz.py checks it in processes of
their own.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack
from hivemind.utils.serializer import MSGPackSerializer

MAX_EXT_DEPTH = 32  # our records nest tuples 2 deep; hivemind's own values a few more

_nesting = threading.local()


def _decode_ext_types(cls: type[MSGPackSerializer], type_code: int, data: bytes) -> Any:
    """hivemind's decoding of one extension value, counted: a registered type's own unpackb (0x50's
    calls MSGPackSerializer.loads again) and a tuple's body both decode through this hook."""
    depth = getattr(_nesting, "depth", 0)
    if depth >= MAX_EXT_DEPTH:
        raise ValueError(f"msgpack extension types nested deeper than {MAX_EXT_DEPTH}")
    _nesting.depth = depth + 1
    try:
        if type_code == cls._TUPLE_EXT_TYPE_CODE and type_code not in cls._ext_type_codes:
            return tuple(msgpack.unpackb(data, ext_hook=cls._decode_ext_types, raw=False))
        return _original(type_code, data)
    finally:
        _nesting.depth = depth


_original = MSGPackSerializer._decode_ext_types


def bound() -> None:
    """Install the bound (idempotent)."""
    MSGPackSerializer._decode_ext_types = classmethod(_decode_ext_types)  # type: ignore[method-assign,assignment]
