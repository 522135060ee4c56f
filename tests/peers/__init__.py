"""Peer implementations that evstore is tested against (differential tests)."""
