"""Event streams of the three dialects, one module each (``chat``, ``responses``, ``messages``),
reassembled into the complete response object, and the ``relay`` that forwards events as
they arrive (``assembly``: what an assembler is).
"""

from rollout_capture.producer.streams.assembly import Assembler, JsonObject
from rollout_capture.producer.streams.chat import ChatAssembler
from rollout_capture.producer.streams.messages import MessagesAssembler
from rollout_capture.producer.streams.relay import StreamRelay, new_assembler, strip_usage
from rollout_capture.producer.streams.responses import ResponsesAssembler

__all__ = [
    "Assembler",
    "ChatAssembler",
    "JsonObject",
    "MessagesAssembler",
    "ResponsesAssembler",
    "StreamRelay",
    "new_assembler",
    "strip_usage",
]
