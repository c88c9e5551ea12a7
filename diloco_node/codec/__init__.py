"""Pseudo-gradient codecs (docs/architecture.md §3): what one node's Δ looks like on the wire.

    codec = make_codec(CodecConfig(name="int8"))  # or make_codec(codec_config_of(node_config))
    payload = codec.encode(flat_fp32)             # top-k and sign also apply their error feedback here
    flat = codec.decode(payload, expected_numel)  # or CodecError: drop that peer's contribution
    SPECS["int8"].header, SPECS["topk"].feedback  # everything one codec is: codecs.CodecSpec
"""

from diloco_node.codec.codecs import CODECS, FEEDBACK, SPECS, Codec, CodecConfig, CodecSpec, codec_config_of, make_codec
from diloco_node.codec.wire import CodecError, max_payload_bytes, split_first

__all__ = ["CODECS", "FEEDBACK", "SPECS", "Codec", "CodecConfig", "CodecError", "CodecSpec", "codec_config_of",
           "make_codec", "max_payload_bytes", "split_first"]
