"""One number per limit: every writer of a stream trims it at the length schemas/limits.py states."""

from __future__ import annotations

from consumer.ops import deadletters, reaper
from consumer.transport import TransportSettings
from producer import ProducerSettings, steps
from schemas import limits


def test_the_cancel_stream_has_one_maxlen() -> None:
    assert steps.CANCEL_MAXLEN == reaper.CANCEL_MAXLEN == TransportSettings().cancel_maxlen == limits.CANCEL_MAXLEN


def test_stream_lengths_and_ttls_come_from_schemas_limits() -> None:
    st = TransportSettings()
    assert (st.result_maxlen, st.dlq_maxlen) == (limits.RESULT_MAXLEN, limits.DLQ_MAXLEN)
    assert deadletters.AUDIT_MAXLEN == limits.DLQ_AUDIT_MAXLEN
    assert reaper.CANCEL_MARKER_TTL_S == limits.CANCEL_MARKER_TTL_S
    assert ProducerSettings().cancel_ttl_s == limits.CANCEL_MARKER_TTL_S
