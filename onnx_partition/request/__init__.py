"""A verb's request, resolved once from the user's options (the command line's or the Python
API's, alike): :class:`~.partition.PartitionRequest`, built by :func:`.resolve.resolve`."""

__all__ = ["partition", "resolve"]
