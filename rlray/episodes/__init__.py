"""Episodes once they are made: the buffer the learner takes them from, the store that
keeps every one (Parquet, local or S3), the ingestion endpoint for episodes made
elsewhere, and `rlray.episodes.read`, which reads a store back."""

from rlray.episodes.reader import format_trace, read, summarize

__all__ = ["format_trace", "read", "summarize"]
